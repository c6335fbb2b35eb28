"""The CPU demo: GRPO vs CAPO on a synthetic arithmetic task with a tiny Qwen2.

``task`` (questions, written solutions, splits), ``char_tokenizer`` (the
task's ``Tokenizer``), ``warm_start`` (SFT to a cached base policy, and the
held-out evaluation the RL demo runs before and after training).
"""
