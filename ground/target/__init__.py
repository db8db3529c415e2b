"""The frozen target every layer works with:

load.py      a built-in name, a Hugging Face folder or a GGUF -> LoadedTarget (model, tokenizer)
identity.py  TargetIdentity (what a head was made for), its checks, the stop token ids
parts.py     its embeddings, LM head and decoder, whatever the family
chat.py      a chat rendered with its template
media.py     images in its prompts (vision-language targets)
"""
