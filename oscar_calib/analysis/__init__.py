"""Analysis of artifacts: evaluation, the compared methods and peers, probes, the audit and its plots."""
