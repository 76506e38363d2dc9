"""llama.cpp server's routes: /infill, /tokenize, /rerank."""
