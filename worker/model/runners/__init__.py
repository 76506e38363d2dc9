"""the MLX runner and what it steps: batch generator, sampler, logprobs, trace, chat/vision/null runners."""
