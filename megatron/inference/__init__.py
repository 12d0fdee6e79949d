"""Using a trained model: loading it at any TP size, generation, and evaluation tasks."""
