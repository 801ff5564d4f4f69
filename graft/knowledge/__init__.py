"""The verified-knowledge flywheel: tasks, verifiers, the library of verified entries in the
store, and the loop that attempts, verifies, deposits and answers from the library.

Modules: tasks (seeded task families, JSONL task and solution files), verifiers (one answer
extraction rule, exact checks), library (entries deposited as KV, BM25 retrieval).
"""
