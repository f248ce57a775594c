"""Publishing a version: to the Hugging Face Hub or a local folder, with its model card and the regression gate.
"""
