//! On-disk slot layout and the slot header.
//!
//! A slot is `data_bytes` of payload area (the block size rounded up to 4 KiB) followed by one
//! 4 KiB header page:
//!
//! ```text
//! | payload (block_bytes, zero padded to data_bytes) | header (4096) |
//! ```
//!
//! The header sits *after* the payload so that a read is one positioned vector read of one
//! contiguous range: the payload lands straight in a host-pool slot and the header in a small
//! aligned buffer, with no bounce copy. A write is the same: one vectored write of payload and
//! header, one op per block (two linked writes, header after payload, halved the blocks in the
//! device's queue at small block sizes). The device may persist the two parts in any order, so
//! a header on disk does not prove its payload: the payload checksum in the header does, and
//! every read checks it (power loss, a write torn by a fatal signal, tampering).
//!
//! Header fields (little endian):
//!
//! | off | size | field |
//! |----:|-----:|-------|
//! | 0   | 8    | magic `KVTSLOT1` |
//! | 8   | 4    | format version |
//! | 12  | 4    | header CRC-32C (this field zeroed; covers bytes 0..HEADER_USED) |
//! | 16  | 8    | generation (monotonic per directory; newest copy of a key wins on recovery) |
//! | 24  | 8    | payload length |
//! | 32  | 4    | payload CRC-32C |
//! | 36  | 4    | global slot number (a header copied to another slot does not verify) |
//! | 40  | 8    | directory id (a slab copied from another directory does not verify) |
//! | 48  | 1    | key length |
//! | 49  | ≤66  | key, `BlockKey::encode` form, compared in full on every read |
//! | 115 | 1    | retention priority 0..=100 (format 2) |
//! | 116 | 8    | Unix time in ms when the priority falls back to the default, 0 = never (format 2) |
//!
//! The header CRC covers the payload CRC, so together they are one checksum over header and
//! payload: any flipped bit in either makes the block a miss.
//!
//! Format 1 (no retention fields; they were zero) is still read, as blocks at the default
//! priority: upgrading kvtier keeps a disk tier's blocks.

use std::time::{SystemTime, UNIX_EPOCH};

use crate::keys::{BlockKey, MAX_KEY_BYTES};
use crate::policy::{InsertHint, DEFAULT_PRIORITY, MAX_PRIORITY};

pub const PAGE: usize = 4096;
pub const HEADER_BYTES: usize = PAGE;
/// Bytes of the header page that carry fields; the rest is zero and checked to be zero.
pub const HEADER_USED: usize = 128;
pub const MAGIC: [u8; 8] = *b"KVTSLOT1";
pub const FORMAT_VERSION: u32 = 2;
/// The format before retention was recorded; still read.
const FORMAT_V1: u32 = 1;
const KEY_OFF: usize = 49;
const MAX_ENCODED_KEY: usize = MAX_KEY_BYTES + 2;
const PRIORITY_OFF: usize = KEY_OFF + MAX_ENCODED_KEY;
const EXPIRES_OFF: usize = PRIORITY_OFF + 1;
const _: () = assert!(EXPIRES_OFF + 8 <= HEADER_USED);

/// Milliseconds since the Unix epoch now (0 if the clock is before it).
pub fn unix_now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// A block's retention as its header records it: the priority it was written with and, if it
/// had a duration, when that runs out. Wall-clock time, not the index's monotonic clock, since
/// it must mean the same to the process that reopens the directory after a restart.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Retention {
    pub priority: u8,
    /// Unix time in ms after which the block is at the default priority; 0 = no duration.
    pub expires_unix_ms: u64,
}

impl Default for Retention {
    fn default() -> Self {
        Retention { priority: DEFAULT_PRIORITY, expires_unix_ms: 0 }
    }
}

impl Retention {
    /// The retention of a block stored at `now_ms` with `hint`. A duration is rounded up to
    /// whole milliseconds.
    pub fn from_hint(hint: InsertHint, now_ms: u64) -> Self {
        let expires_unix_ms = hint.duration_ns.map_or(0, |ns| now_ms.saturating_add(ns.div_ceil(1_000_000)).max(1));
        Retention { priority: hint.priority, expires_unix_ms }
    }

    /// The hint that puts a recovered block back at `now_ms` where it stood: its priority with
    /// what is left of its duration, or the default priority once the duration ran out.
    pub fn to_hint(self, now_ms: u64) -> InsertHint {
        match self.expires_unix_ms {
            0 => InsertHint { priority: self.priority, duration_ns: None },
            t if t <= now_ms => InsertHint::default(),
            t => InsertHint { priority: self.priority, duration_ns: Some((t - now_ms).saturating_mul(1_000_000)) },
        }
    }
}

pub fn round_up_page(n: usize) -> usize {
    n.div_ceil(PAGE) * PAGE
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotHeader {
    pub key: BlockKey,
    pub generation: u64,
    pub payload_len: u64,
    pub payload_crc: u32,
    pub slot: u32,
    pub dir_id: u64,
    pub retention: Retention,
}

/// Why a header did not verify. `Blank` (all zero: never written) is not corruption.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HeaderError {
    Blank,
    BadMagic,
    BadVersion,
    BadChecksum,
    WrongSlot,
    WrongDirectory,
    BadKey,
    BadLength,
    /// A priority outside 0..=100.
    BadRetention,
}

impl SlotHeader {
    /// Write this header into `page` (at least HEADER_BYTES long; the whole page is rewritten).
    pub fn encode_into(&self, page: &mut [u8]) {
        let page = &mut page[..HEADER_BYTES];
        page.fill(0);
        page[0..8].copy_from_slice(&MAGIC);
        page[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
        page[16..24].copy_from_slice(&self.generation.to_le_bytes());
        page[24..32].copy_from_slice(&self.payload_len.to_le_bytes());
        page[32..36].copy_from_slice(&self.payload_crc.to_le_bytes());
        page[36..40].copy_from_slice(&self.slot.to_le_bytes());
        page[40..48].copy_from_slice(&self.dir_id.to_le_bytes());
        let key = self.key.encode();
        debug_assert!(key.len() <= MAX_ENCODED_KEY);
        page[48] = key.len() as u8;
        page[KEY_OFF..KEY_OFF + key.len()].copy_from_slice(&key);
        page[PRIORITY_OFF] = self.retention.priority;
        page[EXPIRES_OFF..EXPIRES_OFF + 8].copy_from_slice(&self.retention.expires_unix_ms.to_le_bytes());
        let crc = crc32c::crc32c(&page[..HEADER_USED]);
        page[12..16].copy_from_slice(&crc.to_le_bytes());
    }

    /// Parse and check a header page read from `slot` of directory `dir_id`. Does not look at
    /// the payload (see `payload_matches`).
    pub fn decode(page: &[u8], slot: u32, dir_id: u64) -> Result<SlotHeader, HeaderError> {
        if page.len() < HEADER_BYTES {
            return Err(HeaderError::BadLength);
        }
        let page = &page[..HEADER_BYTES];
        if page[..8] != MAGIC {
            return Err(if page.iter().all(|&b| b == 0) { HeaderError::Blank } else { HeaderError::BadMagic });
        }
        let u32_at = |o: usize| u32::from_le_bytes(page[o..o + 4].try_into().expect("4 bytes"));
        let u64_at = |o: usize| u64::from_le_bytes(page[o..o + 8].try_into().expect("8 bytes"));
        let version = u32_at(8);
        if version != FORMAT_VERSION && version != FORMAT_V1 {
            return Err(HeaderError::BadVersion);
        }
        let stored = u32_at(12);
        let mut crc = crc32c::crc32c(&page[..12]);
        crc = crc32c::crc32c_append(crc, &[0u8; 4]);
        crc = crc32c::crc32c_append(crc, &page[16..HEADER_USED]);
        // The unused tail must be zero: a flipped bit there is still a damaged header.
        if crc != stored || page[HEADER_USED..].iter().any(|&b| b != 0) {
            return Err(HeaderError::BadChecksum);
        }
        if u32_at(36) != slot {
            return Err(HeaderError::WrongSlot);
        }
        if u64_at(40) != dir_id {
            return Err(HeaderError::WrongDirectory);
        }
        let key_len = page[48] as usize;
        if key_len > MAX_ENCODED_KEY {
            return Err(HeaderError::BadKey);
        }
        let key = BlockKey::decode(&page[KEY_OFF..KEY_OFF + key_len]).ok_or(HeaderError::BadKey)?;
        let retention = if version == FORMAT_V1 {
            Retention::default()
        } else {
            Retention { priority: page[PRIORITY_OFF], expires_unix_ms: u64_at(EXPIRES_OFF) }
        };
        if retention.priority > MAX_PRIORITY {
            return Err(HeaderError::BadRetention);
        }
        Ok(SlotHeader {
            key,
            generation: u64_at(16),
            payload_len: u64_at(24),
            payload_crc: u32_at(32),
            slot,
            dir_id,
            retention,
        })
    }

    /// Whether `payload` (exactly the payload bytes) matches the header's checksum and length.
    pub fn payload_matches(&self, payload: &[u8]) -> bool {
        payload.len() as u64 == self.payload_len && crc32c::crc32c(payload) == self.payload_crc
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> SlotHeader {
        let payload = vec![7u8; 1000];
        SlotHeader {
            key: BlockKey::from_bytes(b"prefix-hash").unwrap(),
            generation: 42,
            payload_len: payload.len() as u64,
            payload_crc: crc32c::crc32c(&payload),
            slot: 9,
            dir_id: 0xdead_beef,
            retention: Retention { priority: 80, expires_unix_ms: 1_700_000_000_123 },
        }
    }

    /// `page` rewritten as format 1 wrote it: version 1, retention bytes zero, CRC redone.
    fn as_format_v1(page: &mut [u8]) {
        page[8..12].copy_from_slice(&FORMAT_V1.to_le_bytes());
        page[PRIORITY_OFF..EXPIRES_OFF + 8].fill(0);
        page[12..16].fill(0);
        let crc = crc32c::crc32c(&page[..HEADER_USED]);
        page[12..16].copy_from_slice(&crc.to_le_bytes());
    }

    #[test]
    fn format_1_headers_read_at_the_default_priority() {
        let h = sample();
        let mut page = vec![0u8; HEADER_BYTES];
        h.encode_into(&mut page);
        as_format_v1(&mut page);
        let got = SlotHeader::decode(&page, 9, 0xdead_beef).unwrap();
        assert_eq!(got, SlotHeader { retention: Retention::default(), ..h });
    }

    #[test]
    fn a_priority_out_of_range_does_not_verify() {
        let mut h = sample();
        h.retention.priority = MAX_PRIORITY + 1;
        let mut page = vec![0u8; HEADER_BYTES];
        h.encode_into(&mut page);
        assert_eq!(SlotHeader::decode(&page, 9, 0xdead_beef), Err(HeaderError::BadRetention));
    }

    #[test]
    fn retention_keeps_what_is_left_of_a_duration() {
        let hint = InsertHint { priority: 90, duration_ns: Some(2_500_000) }; // 2.5 ms -> 3 ms
        let r = Retention::from_hint(hint, 10_000);
        assert_eq!(r, Retention { priority: 90, expires_unix_ms: 10_003 });
        assert_eq!(r.to_hint(10_001), InsertHint { priority: 90, duration_ns: Some(2_000_000) });
        assert_eq!(r.to_hint(10_003), InsertHint::default(), "ran out: back at the default level");
        let forever = Retention::from_hint(InsertHint { priority: 7, duration_ns: None }, 10_000);
        assert_eq!(forever.to_hint(u64::MAX), InsertHint { priority: 7, duration_ns: None });
        // A zero duration still expires (0 would read as "no duration").
        let zero = Retention::from_hint(InsertHint { priority: 90, duration_ns: Some(0) }, 0);
        assert_eq!(zero.to_hint(1), InsertHint::default());
    }

    #[test]
    fn round_trip_and_every_flipped_bit_is_caught() {
        let h = sample();
        let mut page = vec![0u8; HEADER_BYTES];
        h.encode_into(&mut page);
        assert_eq!(SlotHeader::decode(&page, 9, 0xdead_beef), Ok(h));
        // Flip each bit of the used part and a few of the tail: none may decode as valid.
        for byte in (0..HEADER_USED).chain([HEADER_USED, 2000, HEADER_BYTES - 1]) {
            for bit in 0..8 {
                let mut p = page.clone();
                p[byte] ^= 1 << bit;
                assert!(SlotHeader::decode(&p, 9, 0xdead_beef).is_err(), "flip at {byte}.{bit} went unnoticed");
            }
        }
    }

    #[test]
    fn location_and_directory_are_checked() {
        let h = sample();
        let mut page = vec![0u8; HEADER_BYTES];
        h.encode_into(&mut page);
        assert_eq!(SlotHeader::decode(&page, 10, 0xdead_beef), Err(HeaderError::WrongSlot));
        assert_eq!(SlotHeader::decode(&page, 9, 1), Err(HeaderError::WrongDirectory));
        assert_eq!(SlotHeader::decode(&vec![0u8; HEADER_BYTES], 9, 1), Err(HeaderError::Blank));
    }

    #[test]
    fn payload_check_catches_flip_and_length() {
        let h = sample();
        let mut payload = vec![7u8; 1000];
        assert!(h.payload_matches(&payload));
        payload[500] ^= 0x10;
        assert!(!h.payload_matches(&payload));
        assert!(!h.payload_matches(&[7u8; 999]));
    }

    #[test]
    fn int_keys_round_trip() {
        let mut h = sample();
        h.key = BlockKey::from_int(-5);
        let mut page = vec![0u8; HEADER_BYTES];
        h.encode_into(&mut page);
        assert_eq!(SlotHeader::decode(&page, 9, 0xdead_beef).unwrap().key, BlockKey::from_int(-5));
    }
}
