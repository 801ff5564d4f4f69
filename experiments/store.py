"""The knowledge store from the command line (graft/store/_store.py).

  python -m experiments.store put    --store=URL --input=FILE.jsonl
  python -m experiments.store get    --store=URL --text="..."
  python -m experiments.store ls     --store=URL
  python -m experiments.store verify --store=URL      # exit status 1 on any bad object, named
  python -m experiments.store gc     --store=URL [--lease_seconds=3600]
  python -m experiments.store stats  --store=URL

URL is any kvstore URL TensorStore opens: file:///abs/path/, memory:// (this process only),
gs://bucket/path/, s3://bucket/path/, or a TensorStore kvstore spec as JSON (an S3-protocol
server's endpoint: '{"driver": "s3", "bucket": "b", "path": "p/", "endpoint": "http://..."}').
`put` reads one JSON object a line, {"text": ...} (tokenized with BOS) or {"tokens": [ids...]},
and deposits each; a line that also holds {"prefix": [ids...]} is a document, stored after that
prefix (Store.put_document: placed anywhere later; the engine runs --rope=relative). `get` prints the length, in tokens, of the longest stored prefix of the text
(tokenized with BOS). The model and engine flags must be the ones the store was made with (its
namespace): another model, dtype or engine configuration is refused with the reason.
"""

from __future__ import annotations

import json
import sys

from absl import app, flags, logging

from experiments import common
from gemma_jax import files
from graft.store import Store, signing
from graft.store._store import LEASE_SECONDS
from graft.store.publish import STEPS, pause_at

FLAGS = flags.FLAGS
COMMANDS = ('put', 'get', 'ls', 'verify', 'gc', 'stats', 'keygen')


def define_flags() -> None:
  """Flags of this entry point (defined only when it runs, so importing it is free)."""
  flags.DEFINE_string('store', None, 'Store URL (file:///abs/path/, memory://, gs://...).')
  flags.DEFINE_string('input', None, 'JSONL input for put: {"text": ...} or {"tokens": [...]} '
                      'a line.')
  flags.DEFINE_bool('recompute_put', False, 'put: compute every block and compare it with what '
                    'is stored (conflicts replaced and reported).')
  flags.DEFINE_string('text', None, 'get: the text whose longest stored prefix to find.')
  flags.DEFINE_integer('host_cache_bytes', 1 << 30, 'Bound of the store\'s host LRU of verified '
                       'blocks.',
                       lower_bound=0)
  flags.DEFINE_float('recompute', 0.0, 'verify: also recompute this fraction of the blocks (1.0: '
                     'every one) with this engine and compare bytes: forgeries and what was '
                     'built on them.', lower_bound=0.0, upper_bound=1.0)
  flags.DEFINE_float('lease_seconds', None, 'gc: age after which a put\'s lease on its '
                     'unpublished objects has expired (its writer died) and they are removed; '
                     f'unset: {LEASE_SECONDS:g} s. 0: remove every unpublished object (only '
                     'when no put is running).', lower_bound=0.0)
  # Test hooks (tests/test_store.py, experiments/fault_campaign): a writer made to stop inside a put.
  flags.DEFINE_string('pause_at', None, f'put, for tests: STEP:N ({"|".join(STEPS)}): at the '
                      'N-th time the put reaches STEP, print the batch\'s object names on stderr '
                      'and wait to be killed (or for --resume_file).')
  flags.DEFINE_string('resume_file', None, 'put, for tests: with --pause_at, go on once this '
                      'file exists.')
  common.define_store_flags()
  common.define_model_flags()
  common.define_rope_flag()
  common.define_engine_flags()


def read_contexts(path: str, tokenizer) -> list[tuple[list[int] | None, list[int]]]:
  """(prefix or None, token ids) of each line: {"text": ...} with BOS, or {"tokens": [...]} as
  given; with {"prefix": [...]}, a document stored after that prefix."""
  ids = lambda value: (isinstance(value, list) and value
                       and all(type(t) is int for t in value))
  contexts = []
  for number, record in files.jsonl_records(path):
    prefix = record.get('prefix')
    if prefix is not None and not ids(prefix):
      raise ValueError(f'{path}:{number}: "prefix" must be a non-empty list of token ids')
    if isinstance(record.get('text'), str) and record['text']:
      contexts.append((prefix, tokenizer.encode(record['text'], add_bos=prefix is None)))
    elif ids(record.get('tokens')):
      contexts.append((prefix, record['tokens']))
    else:
      raise ValueError(f'{path}:{number}: expected {{"text": "..."}} or {{"tokens": [ids]}}')
  return contexts


def open_store(create: bool = False) -> Store:
  """The store at --store; only put creates one (a read-only command on a missing store is an
  error naming the URL)."""
  engine = common.make_engine(common.load_model())
  return Store(FLAGS.store, engine, host_cache_bytes=FLAGS.host_cache_bytes, create=create,
               **common.store_args())


def main(argv):
  if len(argv) != 2 or argv[1] not in COMMANDS:
    raise app.UsageError(f'expected one command: {" | ".join(COMMANDS)}')
  command = argv[1]
  if command == 'keygen':
    if not FLAGS.signing_key:
      raise app.UsageError('keygen needs --signing_key=KEY (KEY and KEY.pub are written)')
    key = signing.generate(FLAGS.signing_key)
    print(f'wrote {FLAGS.signing_key} and {FLAGS.signing_key}.pub (key {key.public.id})')
    return
  if not FLAGS.store:
    raise app.UsageError('--store=URL is required')
  if command == 'put':
    if not FLAGS.input:
      raise app.UsageError('put needs --input=FILE.jsonl')
    after_step = pause_at(FLAGS.pause_at, FLAGS.resume_file) if FLAGS.pause_at else None
    loaded = common.load_model()
    contexts = read_contexts(FLAGS.input, loaded.tokenizer)  # checked before anything is made
    store = Store(FLAGS.store, common.make_engine(loaded),
                  host_cache_bytes=FLAGS.host_cache_bytes, create=True, after_step=after_step,
                  **common.store_args())
    totals = {'tokens': 0, 'reused_tokens': 0, 'blocks_written': 0, 'bytes_written': 0,
              'conflicts': 0}
    for i, (prefix, tokens) in enumerate(contexts):
      report = (store.put(tokens, recompute=FLAGS.recompute_put) if prefix is None else
                store.put_document(prefix, tokens, recompute=FLAGS.recompute_put))
      for key in totals:
        totals[key] += report[key]
      logging.info('put %d/%d: %d tokens, %d reused, %d blocks written (%d bytes), %.2fs',
                   i + 1, len(contexts), report['tokens'], report['reused_tokens'],
                   report['blocks_written'], report['bytes_written'], report['seconds'])
    print(json.dumps({'contexts': len(contexts), **totals}))
  elif command == 'get':
    if not FLAGS.text:
      raise app.UsageError('get needs --text=...')
    store = open_store()
    tokens = store.engine.loaded.tokenizer.encode(FLAGS.text)
    match = store.lookup(tokens)
    print(match.tokens)
    logging.info('%d of %d tokens stored (%d blocks, %d rows of the last)', match.tokens,
                 len(tokens), len(match.entries), match.rows)
  elif command == 'ls':
    for entry in open_store().entries():
      print(f"{entry['start']:8d}  {entry['key'][:16]}  parent {entry['parent'][:16]}  "
            f"{len(entry['tokens']):3d} tokens  {entry['object_bytes']} bytes")
  elif command == 'verify':
    store = open_store()
    problems = store.verify()
    if FLAGS.recompute:
      problems += store.audit(FLAGS.recompute)
    for problem in problems:
      print(f'BAD {problem.name}: {problem.reason}')
    print(f'{len(problems)} problems')
    if problems:
      sys.exit(1)
  elif command == 'gc':
    lease = LEASE_SECONDS if FLAGS.lease_seconds is None else FLAGS.lease_seconds
    print(json.dumps(open_store().gc(lease_seconds=lease)))
  elif command == 'stats':
    print(json.dumps(open_store().stats(), indent=1))


if __name__ == '__main__':
  define_flags()
  common.run(main)
