"""Local OpenAI-compatible servers, started on 127.0.0.1 for a block and stopped after it
(llama-server, vLLM): the one start / wait / stop rule the backends share."""
