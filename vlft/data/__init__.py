"""The data stage: records in many layouts read and checked, encoded with the chat template, batched,
ordered by a seeded resumable sampler; the embedded demo set.
"""
