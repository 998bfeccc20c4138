"""The report's tables, one module each, every builder beside the Jinja2 template that renders it
(``<module>.md.j2`` in this folder). ``cells`` reads the evidence files all the others are built from."""
