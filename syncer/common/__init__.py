"""Small shared parts every process uses (leaves: no other project imports).

- `settings`: the run settings (`[run]`) and their validation;
- `resolved`: the resolved run configuration (`config.json`): its typed records, one load, one save;
- `keys`: CURVE key files;
- `jsonl`: append-only JSON-lines logs and log streams that never raise;
- `faultpoints`: named fault points for crash tests;
- `atomic`: the one all-or-nothing file write;
- `strictjson`: JSON without NaN or Infinity;
- `smallmath`: a few numeric helpers both ends share.
"""
