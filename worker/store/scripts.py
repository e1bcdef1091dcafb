"""The registry's Lua scripts: every write that must happen together is one script.

Redis runs one script at a time, so each is atomic against every other write: a
publish (blob, manifest, version marker, event, optionally ``live``), a stage change
(pointers, marks, event, compare-and-set) and a prune (deletes what no stage protects).
:class:`worker.store.checkpoints.CheckpointRegistry` registers and calls them.
"""

__all__ = ["PRUNE", "PUBLISH", "SET_STAGES"]

# KEYS: versions, ckpt, manifest, events, stages, lease, live_history
# ARGV: version, blob, manifest, event, token ('' = no fencing), set_live '0'/'1', maxlen,
#       event to record instead when set_live is refused because the probe is pinned,
#       live history length, stage seq expected ('' = unsigned), stage signature, its seq
PUBLISH = """
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
return redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[7], '*', 'event', event)
"""

# KEYS: versions, stages, events, rolled_back, tried, live_history, then keys to delete
# ARGV: field-value pairs JSON, fields to delete JSON, version that must exist ('' = none),
#       event, maxlen, expected stage fields JSON ('' = must be absent),
#       rolled-back marks JSON {version: reason}, versions to mark tried JSON,
#       live history length
# A new live version goes to the front of live_history; rolled-back ones leave it.
SET_STAGES = """
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
for i = 7, #KEYS do redis.call('DEL', KEYS[i]) end
local sets = cjson.decode(ARGV[1])
for k, v in pairs(sets) do redis.call('HSET', KEYS[2], k, v) end
for _, k in ipairs(cjson.decode(ARGV[2])) do redis.call('HDEL', KEYS[2], k) end
if sets['live'] then
  redis.call('LREM', KEYS[6], 0, sets['live'])
  redis.call('LPUSH', KEYS[6], sets['live'])
  redis.call('LTRIM', KEYS[6], 0, tonumber(ARGV[9]) - 1)
end
return redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[5], '*', 'event', ARGV[4])
"""

# KEYS: versions, stages, live_history, then `per` keys of each candidate version
# ARGV: lives protected (the newest n of live_history), per, candidate versions JSON
# Deletes the candidates that are not live, canary or a recent live, atomically with any
# stage change (scripts run one at a time). Returns the versions deleted.
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
    for j = 1, per do redis.call('DEL', KEYS[3 + (i - 1) * per + j]) end
    table.insert(doomed, v)
  end
end
return doomed
"""
