"""OpenAI's APIs: chat and text completions, embeddings, audio, files and batches."""
