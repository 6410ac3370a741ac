//! The upgrade from the key layout before hash tags (`<prefix>fence:<id>`,
//! `<prefix>session:<id>:<turn>`, `<prefix>version:<id>`, `<prefix>turn:<id>`,
//! `<prefix>history:<id>:<v>`, `<prefix>idem:<id>:<digest>`) to the one of today, where every
//! key of a session is `<prefix>session:{<id>}:…`.
//!
//! Proxies of the two layouts on one Redis would not see each other's locks. So a proxy
//! refuses to start while Redis holds keys of the old layout ([`check`]), and
//! `turnlock migrate-keys` ([`migrate`]) moves a stopped deployment over: it refuses while an
//! old proxy still holds a lock, carries each session's fencing counter over (the new counter
//! is raised to at least the old one, so no token lower than one already handed out is handed
//! out again) and deletes the old keys. Idempotency records of the old layout are not carried
//! over: a retry across the upgrade of a write answered before it is applied again by its
//! message ids' rules, not replayed.

use clap::Args;
use redis::RedisError;

use crate::redis_conn::RedisConn;

/// How many `SCAN` rounds (up to 1,000 keys each) the startup check makes per node: it
/// samples a large Redis rather than walk all of it.
const CHECK_ROUNDS: usize = 100;
/// How many `SCAN` rounds `migrate-keys` makes per node at the most (a billion keys).
const MIGRATE_ROUNDS: usize = 1_000_000;

/// `turnlock migrate-keys`: its arguments.
#[derive(Debug, Clone, Args)]
pub struct MigrateArgs {
    /// The Redis the proxies use (any URL form `turnlock proxy --redis` takes).
    #[arg(long, env = "TURNLOCK_REDIS")]
    pub redis: String,
    /// The proxies' `--key-prefix`.
    #[arg(long, env = "TURNLOCK_KEY_PREFIX", default_value = "turnlock:")]
    pub key_prefix: String,
    /// Only list what would be done.
    #[arg(long)]
    pub dry_run: bool,
}

/// What one old-layout key is.
#[derive(Debug, PartialEq, Eq)]
enum Old<'a> {
    /// A session's fencing counter, with the session id.
    Fence(&'a str),
    /// A turn lock, held by a proxy of the old version right now.
    Lock,
    /// A version, turn mark, snapshot or idempotency record.
    Other,
}

/// Sorts a key under `prefix`: `None` when it is not of the old layout.
fn old_kind<'a>(prefix: &str, key: &'a str) -> Option<Old<'a>> {
    let rest = key.strip_prefix(prefix)?;
    if let Some(id) = rest.strip_prefix("fence:") {
        return Some(Old::Fence(id));
    }
    if let Some(after) = rest.strip_prefix("session:") {
        return (!after.starts_with('{')).then_some(Old::Lock);
    }
    ["version:", "turn:", "history:", "idem:"]
        .iter()
        .any(|p| rest.starts_with(p))
        .then_some(Old::Other)
}

/// `prefix` with glob characters escaped, then `*`.
fn pattern(prefix: &str) -> String {
    let mut out = String::with_capacity(prefix.len() + 1);
    for c in prefix.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out.push('*');
    out
}

/// Up to five keys of the old layout under `prefix` (a sample of a large Redis), and the
/// cluster primaries that could not be looked at.
pub async fn find_old(conn: &RedisConn, prefix: &str) -> Result<(Vec<String>, Vec<String>), RedisError> {
    let mut found = Vec::new();
    let (_, failed) = conn
        .scan_reachable(&pattern(prefix), CHECK_ROUNDS, |key| {
            if old_kind(prefix, &key).is_some() {
                found.push(key);
            }
            found.len() < 5
        })
        .await?;
    let unreached = failed
        .into_iter()
        .map(|(node, error)| format!("{node} ({error})"))
        .collect();
    Ok((found, unreached))
}

/// The startup check: an error naming the way out when Redis holds old-layout keys. A Redis
/// that does not answer is not this check's business (the proxy starts and reports it).
pub async fn check(conn: &RedisConn, prefix: &str, redis_display: &str) -> Result<(), String> {
    match find_old(conn, prefix).await {
        Ok((found, unreached)) if found.is_empty() => {
            if !unreached.is_empty() {
                tracing::warn!(
                    unreached = %unreached.join(", "),
                    "could not look for keys of the older key layout on these primaries"
                );
            }
            Ok(())
        }
        Ok((found, _)) => Err(format!(
            "Redis holds keys of turnlock's older key layout ({}): proxies of an older version may \
             still be running on it, and they would not see this version's locks. Stop every proxy \
             of the older version, then run `turnlock migrate-keys --redis {redis_display} --key-prefix {prefix}` \
             (it carries the fencing counters over and removes the old keys), then start this one",
            found.join(", ")
        )),
        Err(error) => {
            tracing::warn!(%error, "could not look for keys of the older key layout");
            Ok(())
        }
    }
}

/// What `migrate-keys` did (or would do).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Migrated {
    pub fences_carried: usize,
    pub deleted: usize,
}

/// Raises the new counter to the old one's value when lower (one key, one slot), and makes it
/// live at least as long as a session's (ARGV[2], ms), as a session's write does. Returns 0
/// when the old counter is not a number (nothing carried).
const RAISE: &str = r"
local current = tonumber(redis.call('GET', KEYS[1]) or '0') or 0
local old = tonumber(ARGV[1])
if not old then
  return 0
end
if old > current then
  redis.call('SET', KEYS[1], ARGV[1], 'KEEPTTL')
end
local ttl = redis.call('PTTL', KEYS[1])
if ttl == -1 or ttl < tonumber(ARGV[2]) then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 1
";

/// How long a carried-over counter lives unless a write renews it: the proxy's default
/// `--session-ttl-secs`.
const CARRIED_TTL_MS: u64 = 7 * 24 * 3600 * 1000;

/// Moves a Redis of the old layout to the new one; refuses while an old proxy holds a lock.
pub async fn migrate(conn: &RedisConn, prefix: &str, dry_run: bool) -> Result<Migrated, String> {
    let mut keys = Vec::new();
    let mut locks = Vec::new();
    conn.scan(&pattern(prefix), MIGRATE_ROUNDS, |key| {
        match old_kind(prefix, &key) {
            Some(Old::Lock) => locks.push(key),
            Some(_) => keys.push(key),
            None => {}
        }
        true
    })
    .await
    .map_err(|e| format!("cannot scan Redis: {e}"))?;
    if !locks.is_empty() {
        return Err(format!(
            "a proxy of the older version holds locks ({}): stop every proxy of the older version first (a lock lapses with its lease)",
            locks.iter().take(5).cloned().collect::<Vec<_>>().join(", ")
        ));
    }
    let mut done = Migrated::default();
    for key in &keys {
        if let Some(Old::Fence(id)) = old_kind(prefix, key) {
            let new_key = format!("{prefix}session:{{{id}}}:fence");
            let carried = if dry_run {
                println!("carry {key} over to {new_key}");
                true
            } else {
                let key = key.as_str();
                let new_key = new_key.as_str();
                conn.run(|mut c| async move {
                    let old: Option<String> = redis::cmd("GET").arg(key).query_async(&mut c).await?;
                    let Some(old) = old else { return Ok(false) };
                    let script = redis::Script::new(RAISE);
                    let carried: i64 = script
                        .key(new_key)
                        .arg(old)
                        .arg(CARRIED_TTL_MS)
                        .invoke_async(&mut c)
                        .await?;
                    Ok(carried == 1)
                })
                .await
                .map_err(|e| format!("cannot carry {key} over: {e}"))?
            };
            if carried {
                done.fences_carried += 1;
            } else {
                tracing::warn!(key = %key, "old fencing counter is not a number; not carried over");
            }
        }
        if dry_run {
            println!("delete {key}");
        } else {
            conn.run(|mut c| async move { redis::cmd("DEL").arg(key).query_async::<()>(&mut c).await })
                .await
                .map_err(|e| format!("cannot delete {key}: {e}"))?;
        }
        done.deleted += 1;
    }
    Ok(done)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn old_layout_keys_are_told_from_new_ones() {
        let p = "turnlock:";
        assert_eq!(old_kind(p, "turnlock:fence:s1"), Some(Old::Fence("s1")));
        assert_eq!(old_kind(p, "turnlock:session:s1:3"), Some(Old::Lock));
        assert_eq!(old_kind(p, "turnlock:idem:s1:abc"), Some(Old::Other));
        assert_eq!(old_kind(p, "turnlock:history:s1:4"), Some(Old::Other));
        assert_eq!(old_kind(p, "turnlock:session:{s1}:fence"), None);
        assert_eq!(old_kind(p, "turnlock:session:{s1}:idem:abc"), None);
        assert_eq!(old_kind(p, "other:fence:s1"), None);
        assert_eq!(pattern("a*[b]?"), "a\\*\\[b\\]\\?*");
    }
}
