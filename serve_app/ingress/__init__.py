"""The HTTP face: the OpenAIIngress deployment, its edge routes (keys, limits, models, tokenize)
and LoRA adapter routes."""
