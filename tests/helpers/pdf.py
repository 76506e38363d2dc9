"""The PDFs tests send (built in bench/hostile/pdf_bytes.py, which the PDF flood bench shares)."""

from mlxgw.bench.hostile.pdf_bytes import pdf_bomb, pdf_with_text

__all__ = ["pdf_bomb", "pdf_with_text"]
