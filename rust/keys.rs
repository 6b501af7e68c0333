//! Block identity.
//!
//! Engines hand us their own digests: vLLM block hashes are bytes (a digest, optionally with a
//! group index appended), TensorRT-LLM block hashes are integers. We keep them *exactly*:
//!
//! - A key is a tagged value: `Int` or `Bytes`. The tag takes part in equality, so the integer 7
//!   and the byte string b"\x07" are different keys.
//! - Bytes keys keep every byte and their length (1..=64); equality compares the full content,
//!   never a hash of it. Hashing is used only to pick a map bucket, so a hash collision costs a
//!   comparison, never a wrong block.
//! - Integers are kept as i128, which holds both signed and unsigned 64-bit engine hashes
//!   without wrapping (u64::MAX and -1 stay different keys).
//!
//! Keys longer than 64 bytes, empty keys, or other types are rejected at the boundary with a
//! clear error instead of being truncated or hashed down.

use std::fmt;
use std::hash::{Hash, Hasher};

use crate::error::{KvError, KvResult};

pub const MAX_KEY_BYTES: usize = 64;

#[derive(Clone, Copy)]
pub struct KeyBytes {
    len: u8,
    buf: [u8; MAX_KEY_BYTES],
}

impl KeyBytes {
    pub fn as_slice(&self) -> &[u8] {
        &self.buf[..self.len as usize]
    }
}

impl PartialEq for KeyBytes {
    fn eq(&self, other: &Self) -> bool {
        self.as_slice() == other.as_slice()
    }
}
impl Eq for KeyBytes {}

impl Hash for KeyBytes {
    fn hash<H: Hasher>(&self, state: &mut H) {
        // Length is hashed too (via the slice impl), so prefixes of each other land apart.
        self.as_slice().hash(state)
    }
}

/// An integer key, stored as two words so that keys need no 16-byte alignment (an `i128`
/// field pads every key from 80 to 96 bytes, and the index holds every key twice).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct KeyInt([u64; 2]);

impl KeyInt {
    fn new(v: i128) -> Self {
        KeyInt([v as u64, (v >> 64) as u64])
    }
    pub fn get(self) -> i128 {
        (u128::from(self.0[0]) | (u128::from(self.0[1]) << 64)) as i128
    }
}

/// The exact value of a key.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub enum KeyValue {
    Int(KeyInt),
    Bytes(KeyBytes),
}

/// A block key: its exact value plus a hash of it computed once at construction. Maps, policy
/// queues and the admission sketch hash a key many times per operation; they all reuse this
/// one. Equality compares the hash first (a fast reject) and then the full value, so a hash
/// collision can never make two keys equal.
#[derive(Clone, Copy)]
pub struct BlockKey {
    hash: u64,
    value: KeyValue,
}

impl PartialEq for BlockKey {
    fn eq(&self, other: &Self) -> bool {
        self.hash == other.hash && self.value == other.value
    }
}
impl Eq for BlockKey {}

impl Hash for BlockKey {
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write_u64(self.hash)
    }
}

fn key_hash(value: &KeyValue) -> u64 {
    use std::hash::BuildHasher;
    // Fixed seed: the hash only places keys in memory, it is never persisted or compared across
    // processes, but a fixed seed keeps eviction order reproducible run to run.
    foldhash::fast::FixedState::with_seed(0x6b76_7469_6572_6b65).hash_one(value)
}

impl BlockKey {
    fn new(value: KeyValue) -> Self {
        BlockKey { hash: key_hash(&value), value }
    }

    pub fn value(&self) -> &KeyValue {
        &self.value
    }

    /// The 64-bit hash computed at construction (places the key in maps; never identity).
    pub fn hash64(&self) -> u64 {
        self.hash
    }

    pub fn from_int(v: i128) -> Self {
        BlockKey::new(KeyValue::Int(KeyInt::new(v)))
    }

    pub fn from_bytes(b: &[u8]) -> KvResult<Self> {
        if b.is_empty() {
            return Err(KvError::invalid("key", "bytes key is empty"));
        }
        if b.len() > MAX_KEY_BYTES {
            return Err(KvError::invalid(
                "key",
                format!("bytes key is {} bytes long, at most {MAX_KEY_BYTES} are allowed", b.len()),
            ));
        }
        let mut buf = [0u8; MAX_KEY_BYTES];
        buf[..b.len()].copy_from_slice(b);
        Ok(BlockKey::new(KeyValue::Bytes(KeyBytes { len: b.len() as u8, buf })))
    }

    /// A stable, self-describing encoding (tag byte, length byte, content) for persistence:
    /// the disk tier stores this in slot headers and compares it in full on every read.
    pub fn encode(&self) -> Vec<u8> {
        match &self.value {
            KeyValue::Int(v) => {
                let mut out = vec![0u8, 16];
                out.extend_from_slice(&v.get().to_le_bytes());
                out
            }
            KeyValue::Bytes(b) => {
                let mut out = vec![1u8, b.len];
                out.extend_from_slice(b.as_slice());
                out
            }
        }
    }

    /// Inverse of `encode`; returns None for anything malformed (used on untrusted disk data).
    pub fn decode(data: &[u8]) -> Option<Self> {
        let (&tag, rest) = data.split_first()?;
        let (&len, rest) = rest.split_first()?;
        let body = rest.get(..len as usize)?;
        match tag {
            0 if len == 16 => Some(BlockKey::from_int(i128::from_le_bytes(body.try_into().ok()?))),
            1 => BlockKey::from_bytes(body).ok(),
            _ => None,
        }
    }
}

impl fmt::Debug for BlockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.value {
            KeyValue::Int(v) => write!(f, "Int({})", v.get()),
            KeyValue::Bytes(b) => {
                write!(f, "Bytes(")?;
                for byte in b.as_slice() {
                    write!(f, "{byte:02x}")?;
                }
                write!(f, ")")
            }
        }
    }
}

impl fmt::Display for BlockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn int_and_bytes_never_collide() {
        let a = BlockKey::from_int(7);
        let b = BlockKey::from_bytes(&[7]).unwrap();
        assert_ne!(a, b);
        let set: HashSet<_> = [a, b].into_iter().collect();
        assert_eq!(set.len(), 2);
    }

    #[test]
    fn unsigned_and_signed_extremes_stay_distinct() {
        assert_ne!(BlockKey::from_int(u64::MAX as i128), BlockKey::from_int(-1));
    }

    #[test]
    fn bytes_compare_in_full_including_length() {
        let a = BlockKey::from_bytes(&[1, 2, 3]).unwrap();
        let b = BlockKey::from_bytes(&[1, 2, 3, 0]).unwrap();
        assert_ne!(a, b);
        let mut long = [9u8; 64];
        let c = BlockKey::from_bytes(&long).unwrap();
        long[63] = 8;
        assert_ne!(c, BlockKey::from_bytes(&long).unwrap());
    }

    #[test]
    fn keys_stay_compact() {
        // Every resident key is held twice (map and slot record); alignment padding matters.
        assert_eq!(std::mem::size_of::<BlockKey>(), 80);
    }

    #[test]
    fn integer_keys_round_trip_their_full_range() {
        for v in [0i128, -1, i128::MIN, i128::MAX, u64::MAX as i128, -(u64::MAX as i128)] {
            let KeyValue::Int(k) = *BlockKey::from_int(v).value() else { unreachable!() };
            assert_eq!(k.get(), v);
        }
    }

    #[test]
    fn rejects_empty_and_oversized() {
        assert!(BlockKey::from_bytes(&[]).is_err());
        assert!(BlockKey::from_bytes(&[0u8; 65]).is_err());
    }

    #[test]
    fn encode_round_trips() {
        for k in [
            BlockKey::from_int(i128::MIN),
            BlockKey::from_int(42),
            BlockKey::from_bytes(&[0xab; 64]).unwrap(),
            BlockKey::from_bytes(b"x").unwrap(),
        ] {
            assert_eq!(BlockKey::decode(&k.encode()), Some(k));
        }
        assert_eq!(BlockKey::decode(&[2, 1, 0]), None);
        assert_eq!(BlockKey::decode(&[1, 5, 1]), None);
    }
}
