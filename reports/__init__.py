"""`make report`: evidence/arithmetic.txt and reports/REPORT.md, pure functions of the evidence."""
