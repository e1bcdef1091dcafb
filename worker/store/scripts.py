"""The Lua scripts: every write that must happen together is one script.

Redis runs one script at a time, so each is atomic against every other write: a
publish (blob, manifest, version marker, event, optionally ``live``), a stage change
(pointers, marks, event, compare-and-set) and a prune (deletes what no stage protects),
which :class:`worker.store.checkpoints.CheckpointRegistry` registers and calls; a scored
batch's evidence and review budget (``SCORED``) and label credit (``CREDIT``), which
:class:`worker.store.evidence.EvidenceStore` calls.

Every script that writes more than deletes is safe to run twice: redis-py re-sends a
command whose reply was lost to a socket timeout (``Retry`` in
:func:`worker.store.redis.make_redis`), after the script may already have run. Each
takes a *once* key (``Keys.once``, a fresh request id per call, TTL
:data:`ONCE_TTL_S`): the first run stores its reply there, a re-run returns it and
writes nothing. PRUNE needs none (a re-run finds nothing more to delete).
"""

__all__ = ["CREDIT", "NEXT_SEQ", "ONCE_TTL_S", "PRUNE", "PUBLISH", "SCORED", "SET_STAGES"]

# How long a script's reply is kept for a re-run: far beyond redis-py's retries (at most
# 10, each waiting at most the socket timeout), and short enough that one key per call
# costs little (about 0.1 KB; 300 scored batches a second keep ~180,000 of them).
ONCE_TTL_S = 600

# KEYS: versions, ckpt, manifest, events, stages, lease, live_history, once
# ARGV: version, blob, manifest, event, token ('' = no fencing), set_live '0'/'1', maxlen,
#       event to record instead when set_live is refused because the probe is pinned,
#       live history length, stage seq expected ('' = unsigned), stage signature, its seq,
#       once TTL
PUBLISH = """
local done = redis.call('GET', KEYS[8])
if done then return done end
if ARGV[5] ~= '' then
  local cur = redis.call('GET', KEYS[6])
  local token = cur and string.match(cur, '^(%d+)|')
  if token ~= ARGV[5] then
    return redis.error_reply('FENCED token ' .. ARGV[5] .. ' is not the lease holder ('
      .. tostring(cur) .. ')')
  end
end
if redis.call('ZSCORE', KEYS[1], ARGV[1]) then
  return redis.error_reply('EXISTS version ' .. ARGV[1] .. ' is already published')
end
if ARGV[6] == '1' and ARGV[10] ~= '' then
  local seq = redis.call('HGET', KEYS[5], 'seq') or '0'
  if seq ~= ARGV[10] and redis.call('HGET', KEYS[5], 'pinned') ~= '1' then
    return redis.error_reply('CHANGED seq is ' .. seq .. ', expected ' .. ARGV[10])
  end
end
redis.call('SET', KEYS[2], ARGV[2])
redis.call('SET', KEYS[3], ARGV[3])
redis.call('ZADD', KEYS[1], ARGV[1], ARGV[1])
local event = ARGV[4]
if ARGV[6] == '1' then
  if redis.call('HGET', KEYS[5], 'pinned') == '1' then
    event = ARGV[8]
  else
    redis.call('HSET', KEYS[5], 'live', ARGV[1])
    if ARGV[10] ~= '' then
      redis.call('HSET', KEYS[5], 'seq', ARGV[12], 'sig', ARGV[11])
    end
    redis.call('LREM', KEYS[7], 0, ARGV[1])
    redis.call('LPUSH', KEYS[7], ARGV[1])
    redis.call('LTRIM', KEYS[7], 0, tonumber(ARGV[9]) - 1)
  end
end
local id = redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[7], '*', 'event', event)
redis.call('SET', KEYS[8], id, 'EX', ARGV[13])
return id
"""

# KEYS: versions, stages, events, rolled_back, tried, live_history, once, then keys to
#       delete
# ARGV: field-value pairs JSON, fields to delete JSON, version that must exist ('' = none),
#       event, maxlen, expected stage fields JSON ('' = must be absent),
#       rolled-back marks JSON {version: reason}, versions to mark tried JSON,
#       live history length, once TTL
# A new live version goes to the front of live_history; rolled-back ones leave it.
SET_STAGES = """
local done = redis.call('GET', KEYS[7])
if done then return done end
if ARGV[3] ~= '' and not redis.call('ZSCORE', KEYS[1], ARGV[3]) then
  return redis.error_reply('UNKNOWN version ' .. ARGV[3] .. ' is not published')
end
for k, want in pairs(cjson.decode(ARGV[6])) do
  local cur = redis.call('HGET', KEYS[2], k) or ''
  if cur ~= want then
    return redis.error_reply('CHANGED ' .. k .. ' is ' .. (cur == '' and 'unset' or cur)
      .. ', expected ' .. (want == '' and 'unset' or want))
  end
end
for v, why in pairs(cjson.decode(ARGV[7])) do
  redis.call('HSET', KEYS[4], v, why)
  redis.call('LREM', KEYS[6], 0, v)
end
for _, v in ipairs(cjson.decode(ARGV[8])) do redis.call('SADD', KEYS[5], v) end
for i = 8, #KEYS do redis.call('DEL', KEYS[i]) end
local sets = cjson.decode(ARGV[1])
for k, v in pairs(sets) do redis.call('HSET', KEYS[2], k, v) end
for _, k in ipairs(cjson.decode(ARGV[2])) do redis.call('HDEL', KEYS[2], k) end
if sets['live'] then
  redis.call('LREM', KEYS[6], 0, sets['live'])
  redis.call('LPUSH', KEYS[6], sets['live'])
  redis.call('LTRIM', KEYS[6], 0, tonumber(ARGV[9]) - 1)
end
local id = redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[5], '*', 'event', ARGV[4])
redis.call('SET', KEYS[7], id, 'EX', ARGV[10])
return id
"""

# KEYS: versions, stages, live_history, rolled_back, tried, then `per` keys of each
#       candidate version
# ARGV: lives protected (the newest n of live_history), per, candidate versions JSON
# Deletes the candidates that are not live, canary or a recent live, atomically with any
# stage change (scripts run one at a time), and the rolled_back/tried marks of every
# version no longer retained (else both grow forever, and the rollout check reads them
# whole every few seconds). Returns the versions deleted.
PRUNE = """
local protected = {}
for _, k in ipairs({'live', 'canary'}) do
  local v = redis.call('HGET', KEYS[2], k)
  if v then protected[v] = true end
end
for _, v in ipairs(redis.call('LRANGE', KEYS[3], 0, tonumber(ARGV[1]) - 1)) do
  protected[v] = true
end
local per = tonumber(ARGV[2])
local doomed = {}
for i, v in ipairs(cjson.decode(ARGV[3])) do
  local vs = tostring(v)
  if not protected[vs] and redis.call('ZSCORE', KEYS[1], vs) then
    redis.call('ZREM', KEYS[1], vs)
    for j = 1, per do redis.call('DEL', KEYS[5 + (i - 1) * per + j]) end
    table.insert(doomed, v)
  end
end
for _, v in ipairs(redis.call('HKEYS', KEYS[4])) do
  if not redis.call('ZSCORE', KEYS[1], v) then redis.call('HDEL', KEYS[4], v) end
end
for _, v in ipairs(redis.call('SMEMBERS', KEYS[5])) do
  if not redis.call('ZSCORE', KEYS[1], v) then redis.call('SREM', KEYS[5], v) end
end
return doomed
"""

# Shared by SCORED and CREDIT: sum ``ops`` ({key index, field, amount, is_float}) into
# ``sums`` (key index -> field -> {amount, is_float}), then write them with one HINCRBY
# (or HINCRBYFLOAT) per key and field.
_SUMS = """
local function add(sums, ops)
  for _, op in ipairs(ops) do
    local k, f = op[1], op[2]
    sums[k] = sums[k] or {}
    local cur = sums[k][f]
    if cur then cur[1] = cur[1] + op[3] else sums[k][f] = {op[3], op[4]} end
  end
end
local function write(sums, base)
  for k, fields in pairs(sums) do
    for f, v in pairs(fields) do
      if v[2] == 1 then
        redis.call('HINCRBYFLOAT', KEYS[base + k], f, string.format('%.3f', v[1]))
      elseif v[1] ~= 0 then
        redis.call('HINCRBY', KEYS[base + k], f, string.format('%d', v[1]))
      end
    end
  end
end
"""

# The head and tail of the scripts that run once per request id (KEYS[1]): a re-run (redis-py
# retrying after a lost reply) returns the first run's answer, kept for ``a.once_ttl``.
_ONCE = (
    """
local done = redis.call('GET', KEYS[1])
if done then return done end
local a = cjson.decode(ARGV[1])
"""
    + _SUMS
)
_REMEMBER = """redis.call('SET', KEYS[1], out, 'EX', a.once_ttl)
return out
"""

# One scored batch's evidence and review requests, exactly once per Kafka record.
# KEYS: once, review budget, then ``np`` high-water keys (one per topic partition in the
# batch), ``nm`` review-marker keys, ``ne`` evidence hashes, then other hashes (drift).
# ARGV[1]: JSON {np, nm, ne, hw_ttl, mark_ttl, once_ttl, budget, window_ttl,
#   sets: [[hash (1-based, after the evidence), field, value, ttl]],
#   recs: [[partition (1-based, 0: no Kafka record), offset, contribution (0: none)]],
#   contribs: [[[evidence key (1-based), field, amount, is_float]]],
#   reviews: [[rec (1-based), marker (1-based)]]}
# A record counts when its offset is above its partition's high-water mark: a redelivered
# record (same partition, same offset) was counted by the delivery that moved the mark. A
# review request is charged to the budget once, by the delivery that counted its record,
# which sets its marker; a redelivery re-sends it (free) only if the marker says it was
# admitted. The reply (counted messages, then '0'/'1' per review: admitted) is kept under
# the once key, so redis-py re-running the script after a lost reply gets the same answer.
SCORED = (
    _ONCE
    + """
local np, nm = a.np, a.nm
local hw, top, fresh, sums = {}, {}, {}, {}
for p = 1, np do hw[p] = tonumber(redis.call('GET', KEYS[2 + p]) or '-1') end
local counted = 0
for i, r in ipairs(a.recs) do
  local p, off, c = r[1], r[2], r[3]
  local new = true
  if p > 0 then
    new = off > hw[p]
    if top[p] == nil or off > top[p] then top[p] = off end
  end
  fresh[i] = new
  if new and c > 0 then
    counted = counted + 1
    add(sums, a.contribs[c])
  end
end
for p, off in pairs(top) do
  redis.call('SET', KEYS[2 + p], string.format('%d', math.max(off, hw[p])), 'EX', a.hw_ttl)
end
write(sums, 2 + np + nm)
for _, h in ipairs(a.sets) do
  local key = KEYS[2 + np + nm + a.ne + h[1]]
  redis.call('HSET', key, h[2], h[3])
  redis.call('EXPIRE', key, h[4])
end
local used = tonumber(redis.call('GET', KEYS[2]) or '0')
local charged, admitted = 0, {}
for j, rv in ipairs(a.reviews) do
  local marker = KEYS[2 + np + rv[2]]
  local ok = '0'
  if fresh[rv[1]] then
    if used + charged < a.budget and redis.call('SET', marker, 1, 'NX', 'EX', a.mark_ttl) then
      charged = charged + 1
      ok = '1'
    end
  elseif redis.call('EXISTS', marker) == 1 then
    ok = '1'
  end
  admitted[j] = ok
end
if charged > 0 then
  redis.call('INCRBY', KEYS[2], charged)
  redis.call('EXPIRE', KEYS[2], a.window_ttl)
end
local out = counted .. '|' .. table.concat(admitted)
"""
    + _REMEMBER
)

# Label credit, exactly once per (probe, message) and (probe, head, message): the marker
# and the counts in one step, so no crash can leave a marker without its counts.
# KEYS: once, then ``nm`` marker keys, then evidence hashes and pairs lists.
# ARGV[1]: JSON {nm, ttl, once_ttl, pairs_max,
#   marks: [[[[key (1-based, after the markers), field, amount, 0]], [[key, value]]]]}
# Returns '0'/'1' per marker: credited now (kept under the once key, as SCORED).
CREDIT = (
    _ONCE
    + """
local base = 1 + a.nm
local sums, pushed, flags = {}, {}, {}
for i, m in ipairs(a.marks) do
  if redis.call('SET', KEYS[1 + i], 1, 'NX', 'EX', a.ttl) then
    flags[i] = '1'
    add(sums, m[1])
    for _, kv in ipairs(m[2]) do
      if a.pairs_max > 0 then
        redis.call('LPUSH', KEYS[base + kv[1]], kv[2])
        pushed[kv[1]] = true
      end
    end
  else
    flags[i] = '0'
  end
end
write(sums, base)
for k, _ in pairs(pushed) do redis.call('LTRIM', KEYS[base + k], 0, a.pairs_max - 1) end
local out = table.concat(flags)
"""
    + _REMEMBER
)

# KEYS: stage_seq.  Returns the next seq of a signed stage record: above the counter, and
# at least the server's clock in milliseconds. Scorers refuse a record older than the
# newest they have seen (a replay); a counter set back by a failover that lost the last
# writes, or by a snapshot restore, would otherwise issue seqs they refuse until restarted,
# while the clock has moved past every seq issued before. (TIME in a script needs effect
# replication, the default since Redis 7, and was allowed from 5 on.) A re-run after a
# lost reply issues a higher seq: harmless, seqs need only grow.
NEXT_SEQ = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local n = redis.call('INCR', KEYS[1])
if n < now then
  redis.call('SET', KEYS[1], string.format('%d', now))
  n = now
end
return n
"""
