"""What a file of each architecture holds, torch-free: metadata -> ModelSpec, tensor names and shapes. The model
module of the same name (models/qwen3moe.py, ...) adds the math: Model, state_bytes."""
