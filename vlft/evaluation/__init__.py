"""Evaluation: scoring answers, generation, and loading a trained adapter for inference."""
