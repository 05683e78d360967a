"""OpenAI's API: protocol bodies, error bodies, the path every request takes, completion and chat
bodies, chat deltas, tool calls, structured fields, logprobs, prompts, embeddings, and the
Responses API."""
