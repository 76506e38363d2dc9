"""Text in and out of a model: chat templates, prompts, streaming detokenization, tool-call and
reasoning parsing, constraints, FIM prompts. The lowest floor: imports only shared/."""
