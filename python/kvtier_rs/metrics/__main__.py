"""`python -m kvtier_rs.metrics`: print the table of the exported series that docs/operations.md holds."""

from kvtier_rs.metrics.names import markdown_table

print(markdown_table())
