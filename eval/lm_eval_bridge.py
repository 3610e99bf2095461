"""lm-eval's own ``gsm8k``, ``minerva_math500`` and ``aime24`` tasks, on local files if need be.

Why: numbers comparable with published ones come from the reference harness itself, not from a
re-implementation. The task definitions are read from the *installed* lm-eval (its YAML, its
filters, its metrics, its ``process_results``); only where the data comes from is changed, so
an offline machine evaluates on the local copies:

- ``gsm8k``:           ``dataset_path: json`` with ``data_files`` {test, train (few-shot) when
                       present; without a train file the few-shot count drops to 0};
- ``minerva_math500``: ``data_files`` {test} (same columns as the hub copy);
- ``aime24``:          the local rows are rewritten to the hub copy's column names (``ID``,
                       ``Problem``, ``Solution``, ``Answer``), which its prompt template uses.

Two entry points: ``run_lm_eval`` runs the harness against the project's model (in memory, or
a checkpoint path, with its tokenizer passed in, as ``HFLM`` needs), and
``lm_eval_item_scores`` feeds given completions through a task's own filter pipeline and
metric, so the project's grader can be checked against lm-eval on identical text.

lm-eval is imported lazily (several seconds); the task index covers only the three task
folders, which takes a fraction of a second instead of half a minute for the full index.
"""

from __future__ import annotations

import json
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Any, Sequence

from eval.data import read_rows, resolve_local

# project benchmark -> (lm-eval task, folder of its YAML under lm_eval/tasks)
LM_EVAL_TASKS: dict[str, tuple[str, str]] = {
    "gsm8k": ("gsm8k", "gsm8k"),
    "math500": ("minerva_math500", "minerva_math"),
    "aime24": ("aime24", "aime"),
}


def _task_name(benchmark: str) -> str:
    try:
        return LM_EVAL_TASKS[benchmark][0]
    except KeyError:
        raise KeyError(f"no lm-eval task for {benchmark!r}; valid: {', '.join(sorted(LM_EVAL_TASKS))}") from None


@lru_cache(maxsize=1)
def task_manager():
    """lm-eval's TaskManager over the installed task folders this project uses."""
    import lm_eval.tasks
    from lm_eval.tasks import TaskManager

    root = Path(lm_eval.tasks.__file__).parent
    folders = sorted({folder for _, folder in LM_EVAL_TASKS.values()})
    return TaskManager(include_defaults=False, include_path=[root / f for f in folders])


def installed_config(benchmark: str) -> dict[str, Any]:
    """The task's config exactly as the installed lm-eval YAML defines it (includes and
    ``!function`` references resolved), before any redirection."""
    from lm_eval.tasks._yaml_loader import load_yaml

    entry = task_manager().task_index[_task_name(benchmark)]
    cfg = dict(load_yaml(entry.yaml_path, resolve_func=True))
    for key in ("tag", "group"):  # structural keys the task factory drops as well
        cfg.pop(key, None)
    return cfg


def local_dataset_overrides(benchmark: str, source: str | Path, workdir: str | Path) -> dict[str, Any]:
    """Config keys that point ``benchmark``'s lm-eval task at the local copy in ``source``
    (a file, or a folder like ``<dir>/<benchmark>/test.jsonl``); ``workdir`` receives any
    rewritten file."""
    test = resolve_local(benchmark, source)
    if test is None:
        raise FileNotFoundError(f"{source} is not a local file or folder")
    over: dict[str, Any] = {"dataset_path": "json", "dataset_name": None}
    if benchmark == "gsm8k":
        files = {"test": str(test)}
        train = test.with_name("train" + test.suffix)
        if test.stem == "test" and train.is_file():
            files["train"] = str(train)
        else:
            over.update(training_split=None, fewshot_split=None, num_fewshot=0)
        over["dataset_kwargs"] = {"data_files": files}
    elif benchmark == "math500":
        over["dataset_kwargs"] = {"data_files": {"test": str(test)}}
    elif benchmark == "aime24":
        out = Path(workdir) / "aime24_hub_schema.jsonl"
        with out.open("w") as f:
            for _, row in read_rows(test):
                low = {str(k).lower(): v for k, v in row.items()}
                hub = {"ID": str(low.get("id", "")), "Problem": low["problem"], "Solution": low.get("solution", ""), "Answer": low["answer"]}
                f.write(json.dumps(hub) + "\n")
        over["dataset_kwargs"] = {"data_files": {"train": str(out)}}  # the task's test_split is "train"
    else:
        _task_name(benchmark)
    return over


def task_config(benchmark: str, source: str | Path | None = None, workdir: str | Path | None = None, **overrides: Any) -> dict[str, Any]:
    """Installed config of ``benchmark``'s task, redirected to ``source`` when given, plus ``overrides``."""
    cfg = installed_config(benchmark)
    if source is not None:
        if workdir is None:
            raise ValueError("a local source needs a workdir for rewritten files")
        cfg.update(local_dataset_overrides(benchmark, source, workdir))
    cfg.update(overrides)
    return cfg


def build_task(benchmark: str, source: str | Path | None = None, workdir: str | Path | None = None, **overrides: Any):
    """An lm-eval ``ConfigurableTask`` built by its TaskManager (loads the dataset)."""
    loaded = task_manager().load([task_config(benchmark, source, workdir, **overrides)])
    return loaded["tasks"][_task_name(benchmark)]


def lm_eval_item_scores(
    task, completions: Sequence[str], filter_name: str, metric: str = "exact_match", docs: Sequence[dict] | None = None
) -> list[float]:
    """Per-document ``metric`` of lm-eval's ``task`` for ``completions`` (one per document of
    ``docs``, default the first ``len(completions)`` of ``task.eval_docs``), through the task's
    own filter ensemble ``filter_name`` (e.g. gsm8k's ``strict-match``) and its own
    ``process_results``: what lm-eval would score had its model produced exactly these texts."""
    from lm_eval.api.instance import Instance

    docs = list(docs) if docs is not None else list(task.eval_docs)[: len(completions)]
    if len(docs) != len(completions):
        raise ValueError(f"{len(completions)} completions for {len(docs)} documents")
    instances = [
        Instance("generate_until", doc, ("", {}), idx=0, metadata=(task.config.task, i, 1), resps=[text])
        for i, (doc, text) in enumerate(zip(docs, completions, strict=True))
    ]
    ensembles = {f.name: f for f in task._filters}  # the pipelines built from the task's filter_list
    if filter_name not in ensembles:
        raise KeyError(f"task {task.config.task} has no filter {filter_name!r}; it has: {', '.join(ensembles)}")
    ensembles[filter_name].apply(instances)
    return [float(task.process_results(inst.doc, [inst.filtered_resps[filter_name]])[metric]) for inst in instances]


def run_lm_eval(
    model: Any,
    tokenizer: Any,
    benchmarks: Sequence[str],
    source: str | Path | None = None,
    limit: int | None = None,
    max_gen_toks: int | None = None,
    num_fewshot: int | None = None,
    batch_size: int = 8,
    apply_chat_template: bool = False,
) -> dict[str, dict[str, Any]]:
    """lm-eval's tasks for ``benchmarks`` against ``model`` (a ``PreTrainedModel`` or a path /
    hub name) with ``tokenizer``; data from ``source`` (a folder like ``<dir>/<benchmark>/
    test.jsonl``) or the hub. Returns ``{benchmark: lm-eval's metrics for its task}``."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
    with tempfile.TemporaryDirectory(prefix="a3po-lm-eval-") as workdir:
        tasks = [task_config(b, source, workdir) for b in benchmarks]
        out = simple_evaluate(
            model=lm,
            tasks=tasks,
            limit=limit,
            num_fewshot=num_fewshot,
            gen_kwargs={"max_gen_toks": max_gen_toks} if max_gen_toks else None,
            task_manager=task_manager(),
            log_samples=False,
            bootstrap_iters=0,
            apply_chat_template=apply_chat_template,
        )
    results = out["results"] if out else {}
    return {
        b: {k: (v.item() if hasattr(v, "item") else v) for k, v in results.get(_task_name(b), {}).items() if k != "alias"}
        for b in benchmarks
    }
