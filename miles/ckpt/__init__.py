"""Checkpoints: atomic trainer checkpoints and resume (`trainer_checkpoint`), Hugging Face exports
(`hf_export`), and the HF <-> megatron `torch_dist` conversion (`convert`).

Every writer here puts its output under a temporary name and renames it when complete, so a run
killed at any moment resumes from the last complete checkpoint. Import the submodule you need; this
package imports nothing heavy.
"""
