"""The store on an object-store protocol: the same store code against an S3-protocol server on
127.0.0.1 (moto's server mode, started here), through TensorStore's `s3` driver with an endpoint.

What the file driver gives and an object store may not (a rename, directories, listing order,
an atomic conditional delete) is not assumed by the store; docs/security.md ("What the store
needs from a kvstore") says what it does need, and the conditional-write test below checks the
requests TensorStore sends for it. Tiny Gemma 3 with random weights; exactness is SHA-256
equality.
"""

import contextlib
import json
import os
import signal
import socket
import tempfile
import urllib.request
import uuid

import pytest

# moto's request recorder writes its file where this names (read when moto is imported), not
# into the working directory.
os.environ.setdefault('MOTO_RECORDER_FILEPATH', os.path.join(
    tempfile.mkdtemp(prefix='moto_recorder.'), 'recording'))
moto_server = pytest.importorskip('moto.server', reason='moto[server] (the test extra) runs the '
                                  'S3-protocol server these tests need')
import boto3  # noqa: E402  (moto's own dependency)

from gemma_jax.compare import sha256_bytes  # noqa: E402
from graft.store import Store  # noqa: E402
from graft.store.publish import PAUSED  # noqa: E402
from graft.store.kvstore import KvStore  # noqa: E402
from tests.test_store import (B, _put_process, engine, fresh_logits, grafted_logits,  # noqa: E402
                              object_names, put_from_two_processes, tokens)

BUCKET = 'gemma-jax-store'
# Credentials for the local server (moto accepts any); no instance-metadata lookups.
AWS_ENV = {'AWS_ACCESS_KEY_ID': 'test', 'AWS_SECRET_ACCESS_KEY': 'test',
           'AWS_REGION': 'us-east-1', 'AWS_EC2_METADATA_DISABLED': 'true'}


@pytest.fixture(scope='module')
def endpoint():
  """An S3-protocol server on a free port of 127.0.0.1 with one bucket; the credentials go into
  the environment, so writer processes started by the tests inherit them."""
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    port = s.getsockname()[1]
  server = moto_server.ThreadedMotoServer(ip_address='127.0.0.1', port=port, verbose=False)
  server.start()
  saved = {k: os.environ.get(k) for k in AWS_ENV}
  os.environ.update(AWS_ENV)
  url = f'http://127.0.0.1:{port}'
  boto3.client('s3', endpoint_url=url, region_name='us-east-1').create_bucket(Bucket=BUCKET)
  try:
    yield url
  finally:
    server.stop()
    for k, v in saved.items():
      if v is None:
        os.environ.pop(k, None)
      else:
        os.environ[k] = v


@pytest.fixture
def spec(endpoint):
  """A fresh store location on the server: a TensorStore kvstore spec as JSON."""
  return json.dumps({'driver': 's3', 'bucket': BUCKET, 'path': f'{uuid.uuid4().hex}/',
                     'endpoint': endpoint, 'aws_region': 'us-east-1'})


@contextlib.contextmanager
def recorded_requests(endpoint):
  """Every request the server receives inside the block: (method, path, if-* headers)."""
  def call(action, method='POST'):
    request = urllib.request.Request(f'{endpoint}/moto-api/recorder/{action}', method=method)
    with urllib.request.urlopen(request, timeout=30) as response:
      return response.read().decode()
  call('reset-recording')
  call('start-recording')
  out = []
  try:
    yield out
  finally:
    call('stop-recording')
    for line in call('download-recording', method='GET').splitlines():
      record = json.loads(line)
      headers = {k.lower(): v for k, v in record.get('headers', {}).items()}
      out.append((record['method'], record['url'].split('?')[0].rsplit('/', 1)[-1],
                  {k: v for k, v in headers.items() if k.startswith('if-')}))


def test_put_graft_verify_gc_on_the_s3_protocol_equal_the_local_store(spec, tmp_path):
  eng = engine()
  store = Store(spec, eng)
  library = tokens(5 * B + 3, 4)
  query = [5, 6, 7]
  report = store.put(library)
  assert report['blocks_written'] == 6
  logits, match = grafted_logits(Store(spec, eng), library, query)  # a second handle reads
  assert match.tokens == len(library)
  assert sha256_bytes(logits) == sha256_bytes(fresh_logits(eng, library, query))
  # The same blocks, byte for byte, as a store on local disk.
  local = Store(f'file://{tmp_path}/s/', eng)
  local.put(library)
  for name in ('objects/', 'index/'):
    assert ([n.split('.')[0] for n in store.backing.list(name)]
            == [n.split('.')[0] for n in local.backing.list(name)])
  assert store.verify() == [] and store.gc() == local.gc()
  assert store.put(library)['blocks_written'] == 0
  # A flipped byte in a stored object: refused, quarantined, and the answer still exact.
  victim = store.lookup(library).entries[2]
  name = f'objects/{victim["object"]}'
  data = bytearray(store.backing.read(name))
  data[-5] ^= 1
  store.backing.write(name, bytes(data))
  reader = Store(spec, eng)
  logits, match = grafted_logits(reader, library, query)
  assert reader.problems and reader.problems[0].key == victim['key']
  assert sha256_bytes(logits) == sha256_bytes(fresh_logits(eng, library, query))
  assert store.backing.list('quarantine/')


def test_conditional_writes_are_the_servers_and_a_conditional_delete_is_checked_first(
    spec, endpoint):
  """put-if-absent and put-if-generation go to the server as one conditional PUT (so two writers
  cannot both win); TensorStore's S3 driver checks a conditional delete with a HEAD and then
  deletes, which docs/security.md states (if this fails, the driver changed: update the doc)."""
  kv = KvStore(spec)
  with recorded_requests(endpoint) as absent:
    assert kv.write_if_absent('store.json', b'first') is True
    assert kv.write_if_absent('store.json', b'second') is False
  assert kv.read('store.json') == b'first'
  puts = [headers for method, _, headers in absent if method == 'PUT']
  assert puts == [{'if-none-match': '*'}]  # one PUT, carrying the condition; the loser sent none
  value, generation = kv.read_versioned('store.json')
  assert kv.replace_if('store.json', b'third', generation) is True
  assert kv.replace_if('store.json', b'fourth', generation) is False  # stale generation
  assert kv.read('store.json') == b'third'
  assert kv.delete_if('store.json', generation) is False
  _, current = kv.read_versioned('store.json')
  with recorded_requests(endpoint) as deleted:
    assert kv.delete_if('store.json', current) is True
  assert kv.read('store.json') is None
  assert [(m, h) for m, _, h in deleted] == [('HEAD', {'if-match': current[1:].decode()}),
                                             ('DELETE', {})]


@pytest.mark.slow
def test_two_writer_processes_on_the_s3_protocol_leave_one_copy(spec, tmp_path):
  contexts = put_from_two_processes(spec, tmp_path)
  store = Store(spec, engine())
  assert store.verify() == []
  assert len(object_names(store)) == len(store.entries()) == sum(-(-len(c) // B) for c in contexts)
  for context in contexts:
    logits, match = grafted_logits(store, context, [9])
    assert match.tokens == len(context)
    assert sha256_bytes(logits) == sha256_bytes(fresh_logits(store.engine, context, [9]))


@pytest.mark.slow
def test_a_writer_killed_inside_a_put_on_the_s3_protocol_loses_nothing(spec, tmp_path):
  eng = engine()
  store = Store(spec, eng)
  earlier = tokens(3 * B, 40)
  store.put(earlier)
  before = {name: store.backing.read(name) for name in store.backing.list('')}
  killed = [tokens(12 * B, 41 + i) for i in range(2)]
  path = tmp_path / 'in.jsonl'
  path.write_text(''.join(json.dumps({'tokens': c}) + '\n' for c in killed))
  proc = _put_process(spec, path, pause='verified:2')
  names = None
  for line in proc.stderr:
    if line.startswith(PAUSED):
      names = json.loads(line[len(PAUSED):].split(maxsplit=1)[1])
      break
  assert names, 'the writer never reported the step'
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  assert proc.returncode == -signal.SIGKILL
  assert set(names) <= set(store.backing.list('objects/'))
  for name, data in before.items():
    assert store.backing.read(name) == data
  reader = Store(spec, eng)
  reader.gc()  # the lease keeps the killed put's objects
  assert set(names) <= set(store.backing.list('objects/'))
  reader.gc(lease_seconds=0)
  assert not set(names) & set(store.backing.list('objects/'))
  assert store.backing.list('staging/') == []
  logits, match = grafted_logits(reader, earlier, [3, 4])
  assert match.tokens == len(earlier)
  assert sha256_bytes(logits) == sha256_bytes(fresh_logits(eng, earlier, [3, 4]))
