"""`python -m kvtier_rs.metrics`: print the README's table of the exported series."""

from kvtier_rs.metrics.names import markdown_table

print(markdown_table())
