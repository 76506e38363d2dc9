"""OpenAI's Responses API: input, output items, tools."""
