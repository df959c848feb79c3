"""A request's prompt as token ids, and as the index's block keys: ``ids`` (what a request's prompt is, and its
keys), ``tokens`` (text and chats through the model's tokenizer), ``chat_template`` (a chat rendered as vLLM
renders it), ``prefix_ids`` (the ids of prompts' pieces seen before, reused)."""
