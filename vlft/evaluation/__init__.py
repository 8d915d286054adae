"""Evaluation: scoring answers, generation, validation loss, and loading a trained adapter for inference.
"""
