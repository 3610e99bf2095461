"""Pure tensor functions of the RL update: losses, proximal anchors, advantages, stability
statistics, minibatch splits, input checks and the optimizer. No models, threads or files."""
