"""Megatron-style tensor- and data-parallel pretraining of GPT and BERT in plain PyTorch."""
