"""The model stage: loading checkpoints and processors, bundled configs, targets, making the model
trainable, the loss, and the embedded default model.
"""
