"""Bridges to the frameworks users already run: `attnlang.integrations.torch` (a PyTorch custom
op, torch.compile- and CUDA-graph-safe) and `attnlang.integrations.transformers` (an attention
backend for transformers). Each imports its framework only when imported itself."""
