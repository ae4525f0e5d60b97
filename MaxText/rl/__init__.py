"""Reinforcement learning from verifiable rewards (objective=rl, configs/rl.yml): GRPO and GSPO through train.py.

rollouts.py  prompts -> num_generations completions each from the inference engine, on the training parameters
rewards.py   the reward functions named in the config, and group-normalised advantages
loss.py      the clipped policy loss per token (GRPO) or per sequence (GSPO), the KL penalty, the aggregations
"""
