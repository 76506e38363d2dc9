"""PDF text extraction as a child process (`python -m mlxgw.gateway.pipeline.pdf_job`, run by
work_pools.run_process_job): the PDF on stdin, {"result": text} or {"error": why} on stdout.

pypdf cannot be interrupted, and one small PDF can be hours of work (1,000 pages sharing one
content stream of 300k operators: 160 KB). So the gateway kills this process at the deadline,
and the extraction keeps its own budget, refusing early what would run long: pages, the
decoded content bytes of all pages together (a shared stream counts once per page that
shows it, as extraction would read it), and text operators."""

from __future__ import annotations

import io

MAX_PAGES = 1000
MAX_CONTENT_BYTES = 16 << 20  # decoded content streams, all pages together
MAX_OPERATORS = 1_000_000  # content-stream operators, all pages together (about 10 s here)


class OverBudget(ValueError):
    pass


def pdf_text(data: bytes) -> str:
    from pypdf import PdfReader

    reader = PdfReader(io.BytesIO(data))
    if reader.is_encrypted and not reader.decrypt(""):
        raise ValueError("the PDF is encrypted")
    pages = reader.pages
    if len(pages) > MAX_PAGES:
        raise OverBudget(f"the PDF has {len(pages)} pages; the limit is {MAX_PAGES}")
    content_bytes = 0
    for page in pages:
        contents = page.get_contents()
        content_bytes += len(contents.get_data()) if contents is not None else 0
        if content_bytes > MAX_CONTENT_BYTES:
            raise OverBudget(f"the PDF's pages hold more than {MAX_CONTENT_BYTES >> 20} MB of content to read")
    operators = 0

    def count(*_args) -> None:
        nonlocal operators
        operators += 1
        if operators > MAX_OPERATORS:
            raise OverBudget(f"the PDF has more than {MAX_OPERATORS:,} drawing operators to read")

    texts = [(page.extract_text(visitor_operand_before=count) or "").strip() for page in pages]
    return "\n\n".join(texts).strip()


if __name__ == "__main__":
    from ..web.work_pools import job_main

    job_main(pdf_text)
