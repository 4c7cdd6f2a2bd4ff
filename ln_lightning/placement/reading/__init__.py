"""Reading the model: which modules are residual blocks and norms, what their forwards do (traced), the registry of block types."""
