"""The teacher stage's recipes (``teacher.method``): the model every student learns from, fine-tuned on the latents."""
