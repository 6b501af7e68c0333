//! Block identity.
//!
//! Engines hand us their own digests: vLLM block hashes are bytes (a digest, optionally with a
//! group index appended), TensorRT-LLM block hashes are integers. We keep them *exactly*:
//!
//! - A key is a tagged value: `Int` or `Bytes`. The tag takes part in equality, so the integer 7
//!   and the byte string b"\x07" are different keys.
//! - Bytes keys keep every byte and their length (1..=64); equality compares the full content,
//!   never a hash of it. Hashing only places keys: the index keys its map by hash and confirms
//!   every candidate against the full key (`index::key_map`), so a hash collision costs a
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

/// Words a key takes in a slot's key record (`BlockKey::to_words`): its hash, its content in
/// little-endian 8-byte words (zero past its length), and its length and kind.
pub const KEY_WORDS: usize = 2 + MAX_KEY_BYTES / 8;
const TAG_WORD: usize = KEY_WORDS - 1;

/// Which kind of engine digest a key holds; part of its identity.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
#[repr(u8)]
enum Kind {
    Int = 0,
    Bytes = 1,
}

/// The exact value of a key, borrowed from it.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum KeyValue<'a> {
    Int(i128),
    Bytes(&'a [u8]),
}

/// A block key: its exact value plus a hash of it computed once at construction. Maps, policy
/// queues and the admission sketch hash a key many times per operation; they all reuse this
/// one. Equality compares the hash first (a fast reject) and then kind, length and content, so
/// a hash collision can never make two keys equal.
///
/// Flat and aligned on purpose (80 bytes, content at offset 8): keys are built once per key per
/// call at the Python boundary and copied into the map, so an enum with an i128 arm (96 bytes)
/// or a 1-byte-aligned buffer (misaligned copies) cost measurably on every lookup. Integers
/// are stored as their 16 little-endian bytes.
#[derive(Clone, Copy)]
pub struct BlockKey {
    hash: u64,
    buf: [u8; MAX_KEY_BYTES],
    len: u8,
    kind: Kind,
}

impl PartialEq for BlockKey {
    fn eq(&self, other: &Self) -> bool {
        // The buffer past `len` is always zero, so comparing whole buffers (a few vector
        // compares, no call) is comparing contents.
        self.hash == other.hash && self.kind == other.kind && self.len == other.len && self.buf == other.buf
    }
}
impl Eq for BlockKey {}

impl Hash for BlockKey {
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write_u64(self.hash)
    }
}

/// A key hashes as exactly one `write_u64` of its precomputed hash, so maps may use that value
/// as it is (`nohash_hasher`). `KeyProbe` hashes the same way, so probes find keys.
impl nohash_hasher::IsEnabled for BlockKey {}
impl nohash_hasher::IsEnabled for &BlockKey {}

/// The last, partial 8-byte word of `content` (whose length is not a multiple of 8) as
/// `BlockKey::to_words` stores it: the tail bytes, zero above. Built from an overlapping load
/// of the last 8 bytes rather than a copy into a zeroed buffer: the copy's byte stores followed
/// by a word load stall store forwarding, which measured as half the cost of a chained lookup.
#[inline]
fn tail_word(content: &[u8]) -> u64 {
    let n = content.len();
    let tail = n % 8;
    if n >= 8 {
        let last = u64::from_le_bytes(content[n - 8..].try_into().expect("8 bytes"));
        last >> (8 * (8 - tail))
    } else {
        content.iter().rev().fold(0u64, |w, &b| (w << 8) | u64::from(b))
    }
}

fn tag_word(kind: Kind, len: u8) -> u64 {
    u64::from(len) | ((kind as u64) << 8)
}

/// The hash seed of this process, drawn at first use. The hash only places keys in memory: it
/// is never persisted or compared across processes (identity is the full key, see
/// `index::key_map`), so nothing needs it stable. A seed nobody can predict keeps requests
/// crafted so that their keys (engine digests of user text) pile up in a few map buckets from
/// slowing every lookup. Eviction order does not depend on it: policies order keys by use, and
/// ghost entries by a 64-bit hash collide only about once in 2^64 pairs.
fn process_seed() -> u64 {
    use std::hash::BuildHasher;
    static SEED: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *SEED.get_or_init(|| std::collections::hash_map::RandomState::new().hash_one(std::process::id()))
}

fn key_hash(kind: Kind, content: &[u8]) -> u64 {
    use std::hash::BuildHasher;
    // The slice's length is hashed too, so keys that are prefixes of each other land apart.
    foldhash::fast::FixedState::with_seed(process_seed()).hash_one((kind, content))
}

impl BlockKey {
    fn new(kind: Kind, content: &[u8]) -> Self {
        Self::with_hash(kind, content, key_hash(kind, content))
    }

    fn with_hash(kind: Kind, content: &[u8], hash: u64) -> Self {
        let mut buf = [0u8; MAX_KEY_BYTES];
        buf[..content.len()].copy_from_slice(content);
        BlockKey { hash, buf, len: content.len() as u8, kind }
    }

    fn as_bytes(&self) -> &[u8] {
        &self.buf[..self.len as usize]
    }

    pub fn value(&self) -> KeyValue<'_> {
        match self.kind {
            Kind::Int => KeyValue::Int(i128::from_le_bytes(self.buf[..16].try_into().expect("16 bytes"))),
            Kind::Bytes => KeyValue::Bytes(self.as_bytes()),
        }
    }

    /// A bytes key given an arbitrary hash, so that tests can make distinct keys collide.
    #[cfg(test)]
    pub(crate) fn with_forced_hash(b: &[u8], hash: u64) -> Self {
        Self::check_bytes(b).expect("a valid key");
        Self::with_hash(Kind::Bytes, b, hash)
    }

    /// The 64-bit hash computed at construction (places the key in maps; never identity).
    pub fn hash64(&self) -> u64 {
        self.hash
    }

    pub fn from_int(v: i128) -> Self {
        BlockKey::new(Kind::Int, &v.to_le_bytes())
    }

    pub fn from_bytes(b: &[u8]) -> KvResult<Self> {
        Self::check_bytes(b)?;
        Ok(BlockKey::new(Kind::Bytes, b))
    }

    #[inline]
    fn check_bytes(b: &[u8]) -> KvResult<()> {
        if b.is_empty() {
            return Err(KvError::invalid("key", "bytes key is empty"));
        }
        if b.len() > MAX_KEY_BYTES {
            return Err(KvError::invalid(
                "key",
                format!("bytes key is {} bytes long, at most {MAX_KEY_BYTES} are allowed", b.len()),
            ));
        }
        Ok(())
    }

    /// The key as the words of a slot key record (see `KEY_WORDS`); `from_words` inverts it.
    pub fn to_words(&self) -> [u64; KEY_WORDS] {
        let mut w = [0u64; KEY_WORDS];
        w[0] = self.hash;
        for (i, chunk) in self.buf.chunks_exact(8).enumerate() {
            w[1 + i] = u64::from_le_bytes(chunk.try_into().expect("8 bytes"));
        }
        w[TAG_WORD] = tag_word(self.kind, self.len);
        w
    }

    /// The key whose words these are. Only for words made by `to_words` (the index keeps its own
    /// records; nothing untrusted is decoded here).
    pub fn from_words(w: &[u64; KEY_WORDS]) -> Self {
        let mut buf = [0u8; MAX_KEY_BYTES];
        for (i, chunk) in buf.chunks_exact_mut(8).enumerate() {
            chunk.copy_from_slice(&w[1 + i].to_le_bytes());
        }
        let kind = if (w[TAG_WORD] >> 8) & 0xff == Kind::Int as u64 { Kind::Int } else { Kind::Bytes };
        BlockKey { hash: w[0], buf, len: (w[TAG_WORD] & 0xff) as u8, kind }
    }

    /// The key as a probe borrowing its content.
    #[inline(always)]
    pub fn as_probe(&self) -> KeyProbe<'_> {
        let content = match self.kind {
            Kind::Bytes => ProbeContent::Bytes(self.as_bytes()),
            Kind::Int => ProbeContent::Int(self.buf[..16].try_into().expect("16 bytes")),
        };
        KeyProbe { hash: self.hash, key: KeyRef(content) }
    }

    /// A stable, self-describing encoding (tag byte, length byte, content) for persistence:
    /// the disk tier stores this in slot headers and compares it in full on every read.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = vec![self.kind as u8, self.len];
        out.extend_from_slice(self.as_bytes());
        out
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

/// A key validated exactly as `BlockKey` would be, but not hashed, whose bytes are borrowed
/// from the caller's memory (a Python `bytes` object) or, for an integer, held inline. A chained
/// lookup compares it with a slot's key record, which needs no hash; `hashed` makes the probe
/// that the map needs.
#[derive(Clone, Copy)]
pub struct KeyRef<'a>(ProbeContent<'a>);

#[derive(Clone, Copy)]
enum ProbeContent<'a> {
    Bytes(&'a [u8]),
    Int([u8; 16]),
}

impl<'a> KeyRef<'a> {
    /// A bytes key, with the same checks as `BlockKey::from_bytes`.
    pub fn bytes(b: &'a [u8]) -> KvResult<Self> {
        BlockKey::check_bytes(b)?;
        Ok(KeyRef(ProbeContent::Bytes(b)))
    }

    /// `bytes` for the hot path: None instead of an error (the caller asks `bytes` for the
    /// error only when there is one; returning a large `Result` costs a stall per call).
    #[inline(always)]
    pub fn try_bytes(b: &'a [u8]) -> Option<Self> {
        BlockKey::check_bytes(b).is_ok().then_some(KeyRef(ProbeContent::Bytes(b)))
    }

    pub fn int(v: i128) -> Self {
        KeyRef(ProbeContent::Int(v.to_le_bytes()))
    }

    fn kind(&self) -> Kind {
        match self.0 {
            ProbeContent::Bytes(_) => Kind::Bytes,
            ProbeContent::Int(_) => Kind::Int,
        }
    }

    fn content(&self) -> &[u8] {
        match &self.0 {
            ProbeContent::Bytes(b) => b,
            ProbeContent::Int(le) => le,
        }
    }

    /// The probe for the map: this key with its hash.
    // Always inlined (as the constructors): a probe returned through memory is written
    // piecewise and read back whole, which stalls store forwarding (measured: over half the
    // cost of a chained lookup).
    #[inline(always)]
    pub fn hashed(&self) -> KeyProbe<'a> {
        KeyProbe { hash: key_hash(self.kind(), self.content()), key: *self }
    }

    /// Whether a key record read word by word (`word(i)` is word i of `BlockKey::to_words`)
    /// holds this key. Compares kind, length and content in full, the tag word first (the
    /// common mismatch is a different key of the same shape, rejected by its first content
    /// word). The hash word is not read: it follows from the content.
    // Always inlined: outlined (as the compiler chose inside generic callers) it was a tenth of
    // a batch store's time.
    #[inline(always)]
    pub fn matches_words(&self, word: impl Fn(usize) -> u64) -> bool {
        let content = self.content();
        if word(TAG_WORD) != tag_word(self.kind(), content.len() as u8) {
            return false;
        }
        let mut chunks = content.chunks_exact(8);
        for (i, chunk) in chunks.by_ref().enumerate() {
            if word(1 + i) != u64::from_le_bytes(chunk.try_into().expect("8 bytes")) {
                return false;
            }
        }
        let tail = chunks.remainder();
        if tail.is_empty() {
            return true;
        }
        word(1 + content.len() / 8) == tail_word(content)
    }
}

/// A key probe: a `KeyRef` with the hash `BlockKey` would have. Lock-free reads and store
/// completion probe the map with it directly, so a call across the Python boundary builds no
/// 80-byte key per item.
#[derive(Clone, Copy)]
pub struct KeyProbe<'a> {
    hash: u64,
    key: KeyRef<'a>,
}

impl<'a> KeyProbe<'a> {
    /// A bytes key, with the same checks as `BlockKey::from_bytes`.
    pub fn bytes(b: &'a [u8]) -> KvResult<Self> {
        Ok(KeyRef::bytes(b)?.hashed())
    }

    /// `bytes` for the hot path: None instead of an error.
    #[inline(always)]
    pub fn try_bytes(b: &'a [u8]) -> Option<Self> {
        KeyRef::try_bytes(b).map(|k| k.hashed())
    }

    pub fn int(v: i128) -> Self {
        KeyRef::int(v).hashed()
    }

    /// The hash `BlockKey::hash64` gives the same key.
    #[inline(always)]
    pub fn hash64(&self) -> u64 {
        self.hash
    }

    /// The key without its hash.
    pub fn key_ref(&self) -> KeyRef<'a> {
        self.key
    }

    /// The key itself (for writers, which keep keys).
    pub fn to_key(&self) -> BlockKey {
        BlockKey::with_hash(self.key.kind(), self.key.content(), self.hash)
    }
}

/// A key that a chained lookup can compare with slot key records (`key_ref`, no hash needed)
/// and, when that fails, look up in the map (`probe`, hashing only then if it must).
pub trait ChainKey {
    fn key_ref(&self) -> KeyRef<'_>;
    fn probe(&self) -> KeyProbe<'_>;
}

impl ChainKey for KeyRef<'_> {
    #[inline(always)]
    fn key_ref(&self) -> KeyRef<'_> {
        *self
    }
    #[inline(always)]
    fn probe(&self) -> KeyProbe<'_> {
        self.hashed()
    }
}

impl ChainKey for KeyProbe<'_> {
    #[inline(always)]
    fn key_ref(&self) -> KeyRef<'_> {
        self.key
    }
    #[inline(always)]
    fn probe(&self) -> KeyProbe<'_> {
        *self
    }
}

impl<T: ChainKey + ?Sized> ChainKey for &T {
    #[inline(always)]
    fn key_ref(&self) -> KeyRef<'_> {
        (**self).key_ref()
    }
    #[inline(always)]
    fn probe(&self) -> KeyProbe<'_> {
        (**self).probe()
    }
}

impl ChainKey for BlockKey {
    #[inline(always)]
    fn key_ref(&self) -> KeyRef<'_> {
        self.as_probe().key
    }
    #[inline(always)]
    fn probe(&self) -> KeyProbe<'_> {
        self.as_probe()
    }
}

impl Hash for KeyProbe<'_> {
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write_u64(self.hash)
    }
}

impl scc::Equivalent<BlockKey> for KeyProbe<'_> {
    fn equivalent(&self, key: &BlockKey) -> bool {
        self.hash == key.hash && self.key.kind() == key.kind && same_bytes(self.key.content(), key.as_bytes())
    }
}

/// Byte-wise equality of two short slices (keys: at most 64 bytes) without a call to `memcmp`,
/// which the map's probe otherwise pays on every lookup: 8-byte words, the last one overlapping
/// the previous when the length is not a multiple of 8.
#[inline]
fn same_bytes(a: &[u8], b: &[u8]) -> bool {
    let n = a.len();
    if n != b.len() {
        return false;
    }
    if n < 8 {
        return a.iter().zip(b).all(|(x, y)| x == y);
    }
    let word = |s: &[u8], at: usize| u64::from_ne_bytes(s[at..at + 8].try_into().expect("8 bytes"));
    let mut at = 0;
    while at + 8 < n {
        if word(a, at) != word(b, at) {
            return false;
        }
        at += 8;
    }
    word(a, n - 8) == word(b, n - 8)
}

impl fmt::Debug for BlockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.value() {
            KeyValue::Int(v) => write!(f, "Int({v})"),
            KeyValue::Bytes(b) => {
                write!(f, "Bytes(")?;
                for byte in b {
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
    fn each_process_hashes_with_its_own_seed() {
        // Run again as a child, the test prints its process's seed and stops there.
        if std::env::var_os("KVTIER_PRINT_SEED").is_some() {
            println!("seed={}", process_seed());
            return;
        }
        let child_seed = || {
            let out = std::process::Command::new(std::env::current_exe().unwrap())
                .args(["--exact", "keys::tests::each_process_hashes_with_its_own_seed", "--nocapture"])
                .args(["--test-threads", "1"])
                .env("KVTIER_PRINT_SEED", "1")
                .output()
                .unwrap();
            let text = String::from_utf8_lossy(&out.stdout).into_owned();
            // The line is shared with the harness's "test ... " prefix.
            let (_, rest) = text.split_once("seed=").unwrap_or_else(|| panic!("{text}"));
            rest.split_whitespace().next().unwrap().parse::<u64>().unwrap()
        };
        let (a, b) = (child_seed(), child_seed());
        assert!(a != b && a != process_seed(), "seeds {a}, {b} and {} are not all distinct", process_seed());
        // Within a process a key always hashes alike, whichever way it was built.
        let k = BlockKey::from_bytes(b"digest").unwrap();
        assert_eq!(k.hash64(), BlockKey::from_bytes(b"digest").unwrap().hash64());
        assert_eq!(ChainKey::key_ref(&k).hashed().hash64(), k.hash64());
    }

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
            assert_eq!(BlockKey::from_int(v).value(), KeyValue::Int(v));
        }
    }

    #[test]
    fn a_borrowed_probe_matches_exactly_its_own_key() {
        use scc::Equivalent;
        let k = BlockKey::from_bytes(b"abc").unwrap();
        let probe = KeyProbe::bytes(b"abc").unwrap();
        assert_eq!(probe.hash, k.hash);
        assert!(probe.equivalent(&k));
        assert!(!KeyProbe::bytes(b"abd").unwrap().equivalent(&k));
        assert!(!KeyProbe::bytes(b"abc\0").unwrap().equivalent(&k));
        assert!(!KeyProbe::bytes(&7i128.to_le_bytes()).unwrap().equivalent(&BlockKey::from_int(7)));
        assert!(KeyProbe::int(7).equivalent(&BlockKey::from_int(7)));
        assert!(!KeyProbe::int(7).equivalent(&BlockKey::from_int(-7)));
        assert!(KeyProbe::int(-1).to_key() == BlockKey::from_int(-1));
        assert!(KeyProbe::bytes(&[]).is_err());
        assert!(KeyProbe::bytes(&[0; 65]).is_err());
    }

    #[test]
    fn same_bytes_is_slice_equality() {
        // Every length up to 64 (short, multiple of 8, and overlapping last word), with each byte
        // position changed in turn.
        for n in 0..=64usize {
            let a: Vec<u8> = (0..n as u8).map(|i| i.wrapping_mul(37).wrapping_add(1)).collect();
            assert!(same_bytes(&a, &a.clone()));
            for i in 0..n {
                let mut b = a.clone();
                b[i] ^= 0x80;
                assert!(!same_bytes(&a, &b), "len {n}, byte {i}");
            }
            if n > 0 {
                assert!(!same_bytes(&a, &a[..n - 1]));
            }
        }
    }

    #[test]
    fn tail_word_is_the_zero_padded_last_word() {
        for n in (1..=64usize).filter(|n| n % 8 != 0) {
            let content: Vec<u8> = (0..n as u8).map(|i| i.wrapping_mul(91).wrapping_add(3)).collect();
            let mut last = [0u8; 8];
            last[..n % 8].copy_from_slice(&content[n / 8 * 8..]);
            assert_eq!(tail_word(&content), u64::from_le_bytes(last), "length {n}");
        }
    }

    #[test]
    fn key_words_round_trip_and_match_exactly_their_key() {
        let mut keys: Vec<BlockKey> = [0i128, 7, -1, i128::MAX].into_iter().map(BlockKey::from_int).collect();
        for n in [1usize, 7, 8, 9, 16, 36, 63, 64] {
            keys.push(BlockKey::from_bytes(&vec![0x5a; n]).unwrap());
        }
        keys.push(BlockKey::from_bytes(&7i128.to_le_bytes()).unwrap());
        for a in &keys {
            let w = a.to_words();
            assert_eq!(BlockKey::from_words(&w), *a);
            for b in &keys {
                assert_eq!(b.as_probe().key_ref().matches_words(|i| w[i]), a == b, "{a:?} vs {b:?}");
            }
            // Any single changed content bit is a different key.
            let bytes = a.encode();
            if bytes[0] == 1 {
                for i in 0..a.as_bytes().len() {
                    let mut other = a.as_bytes().to_vec();
                    other[i] ^= 1;
                    assert!(!KeyRef::bytes(&other).unwrap().matches_words(|j| w[j]));
                }
            }
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
