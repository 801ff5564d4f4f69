"""The verified-knowledge flywheel: tasks, verifiers, the library of verified entries in the
store, and the loop that attempts, verifies, deposits and answers from the library.

    library = Library(Store(url, engine))                 # entries deposited as KV
    library.add(entry, task)                              # verified by the task's verifier first
    results = flywheel.run(engine, library, tasks, ...)   # attempt, verify, deposit, answer

Modules: tasks (seeded task families, JSONL task and solution files), verifiers (one answer
extraction rule, exact checks), library (entries deposited as KV, BM25 retrieval), flywheel (the
loop, what it saved, the replayable manifest), paired (paired statistics of two conditions).
"""

from graft.knowledge import flywheel, library, paired, tasks, verifiers
from graft.knowledge.library import Entry, Library, LibraryError
from graft.knowledge.tasks import Task
from graft.knowledge.verifiers import Verdict

__all__ = ['Entry', 'Library', 'LibraryError', 'Task', 'Verdict', 'flywheel', 'library',
           'paired', 'tasks', 'verifiers']
