//! Admission: whether a block deserves a place in a tier at all, decided before capacity.
//!
//! Independent of the eviction policy. Rules:
//! - `Always`.
//! - `AfterUses(k)`: admit on the k-th observed use. Uses are counted in a small count-min
//!   sketch (4 rows of 8-bit counters) whose counters are all halved every `window` recorded
//!   uses, so old popularity decays and memory stays fixed however many keys pass through.
//!   A count-min sketch never under-counts, so a key used k times is always admitted; a rare
//!   collision can admit a key early, never refuse one wrongly.
//! - `MinPriority(t)`: admit only blocks whose retention priority is at least t.

use std::hash::{BuildHasher, Hash};

use crate::error::{KvError, KvResult};

/// The largest K of `uses:K`: the sketch counts in 8 bits, so a higher threshold would never
/// be reached and the tier would silently admit nothing.
pub const MAX_USES: u32 = u8::MAX as u32;

/// Whether a store's new blocks go through the tier's admission rule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Admit {
    /// Ask the rule: a block offered to this tier (an offload, a write-through).
    ByRule,
    /// Store without asking: a block staged up from a lower tier to be served (a disk hit on
    /// its way to the GPU), which the lower tier's rule admitted already. Refusing it would
    /// turn the hit into a miss.
    Already,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AdmissionRule {
    Always,
    AfterUses(u32),
    MinPriority(u8),
}

impl AdmissionRule {
    /// Parse "always", "uses:K" / "after_uses:K", "priority:T".
    pub fn parse(spec: &str) -> KvResult<Self> {
        let s = spec.trim().to_ascii_lowercase();
        if s == "always" {
            return Ok(AdmissionRule::Always);
        }
        let bad = || {
            KvError::invalid(
                "admission",
                format!(
                    "{spec:?} is not an admission rule; expected \"always\", \"uses:K\" (1..={MAX_USES}) or \
                     \"priority:T\" (0..=100)"
                ),
            )
        };
        let (name, value) = s.split_once(':').ok_or_else(bad)?;
        match name {
            "uses" | "after_uses" => match value.parse::<u32>() {
                Ok(k) if (1..=MAX_USES).contains(&k) => Ok(AdmissionRule::AfterUses(k)),
                _ => Err(bad()),
            },
            "priority" | "min_priority" => match value.parse::<u8>() {
                Ok(t) if t <= 100 => Ok(AdmissionRule::MinPriority(t)),
                _ => Err(bad()),
            },
            _ => Err(bad()),
        }
    }

    pub fn describe(&self) -> String {
        match self {
            AdmissionRule::Always => "always".into(),
            AdmissionRule::AfterUses(k) => format!("uses:{k}"),
            AdmissionRule::MinPriority(t) => format!("priority:{t}"),
        }
    }
}

const ROWS: usize = 4;

/// Count-min sketch with periodic halving (TinyLFU-style aging).
pub struct FrequencySketch {
    width_mask: usize,
    counters: Vec<u8>, // ROWS * width
    hasher: foldhash::fast::FixedState,
    recorded: u64,
    window: u64,
}

impl FrequencySketch {
    /// `expected_keys` sizes the table (next power of two, at least 1024 wide); the decay window
    /// is ten times that.
    pub fn new(expected_keys: usize) -> Self {
        Self::with_window(expected_keys, 10)
    }

    /// `new`, with every counter halved after `windows` times the table's width of recorded
    /// uses. A short window keeps the counts honest when most keys are seen once (each counter
    /// then holds about one key); a long one remembers popularity longer.
    pub fn with_window(expected_keys: usize, windows: u64) -> Self {
        let width = expected_keys.max(1024).next_power_of_two();
        FrequencySketch {
            width_mask: width - 1,
            counters: vec![0; ROWS * width],
            hasher: foldhash::fast::FixedState::with_seed(0x6b76_7469_6572),
            recorded: 0,
            window: (width as u64) * windows.max(1),
        }
    }

    fn slots<K: Hash>(&self, key: &K) -> [usize; ROWS] {
        let h = self.hasher.hash_one(key);
        let width = self.width_mask + 1;
        let mut out = [0; ROWS];
        for (row, slot) in out.iter_mut().enumerate() {
            // Independent-enough row indices from one 64-bit hash (double hashing).
            let h2 = h.rotate_left(17 * row as u32 + 7) ^ (h >> 32);
            *slot = row * width + (h2 as usize & self.width_mask);
        }
        out
    }

    /// Record one use and return the new estimate.
    pub fn record<K: Hash>(&mut self, key: &K) -> u32 {
        let slots = self.slots(key);
        let est = slots.iter().map(|&i| self.counters[i]).min().unwrap_or(0);
        // Conservative update: only raise counters that equal the minimum.
        for &i in &slots {
            if self.counters[i] == est && est < u8::MAX {
                self.counters[i] += 1;
            }
        }
        self.recorded += 1;
        if self.recorded >= self.window {
            self.recorded = 0;
            for c in &mut self.counters {
                *c >>= 1;
            }
        }
        u32::from(est.saturating_add(1))
    }

    pub fn estimate<K: Hash>(&self, key: &K) -> u32 {
        self.slots(key).iter().map(|&i| u32::from(self.counters[i])).min().unwrap_or(0)
    }

    pub fn clear(&mut self) {
        self.counters.fill(0);
        self.recorded = 0;
    }
}

/// A rule plus the state it needs.
pub struct Admission {
    rule: AdmissionRule,
    sketch: Option<FrequencySketch>,
}

impl Admission {
    pub fn new(rule: AdmissionRule, expected_keys: usize) -> Self {
        let sketch = matches!(rule, AdmissionRule::AfterUses(_)).then(|| FrequencySketch::new(expected_keys));
        Admission { rule, sketch }
    }

    pub fn rule(&self) -> AdmissionRule {
        self.rule
    }

    /// Record a use of `key` without asking for admission (e.g. a hit in another tier).
    pub fn record_use<K: Hash>(&mut self, key: &K) {
        if let Some(s) = &mut self.sketch {
            s.record(key);
        }
    }

    /// Record this offer as a use and decide.
    pub fn offer<K: Hash>(&mut self, key: &K, priority: u8) -> bool {
        match self.rule {
            AdmissionRule::Always => true,
            AdmissionRule::MinPriority(t) => priority >= t,
            AdmissionRule::AfterUses(k) => self.sketch.as_mut().expect("sketch exists for AfterUses").record(key) >= k,
        }
    }

    pub fn clear(&mut self) {
        if let Some(s) = &mut self.sketch {
            s.clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_rules_and_reject_garbage() {
        assert_eq!(AdmissionRule::parse("always").unwrap(), AdmissionRule::Always);
        assert_eq!(AdmissionRule::parse("uses:2").unwrap(), AdmissionRule::AfterUses(2));
        assert_eq!(AdmissionRule::parse("priority:50").unwrap(), AdmissionRule::MinPriority(50));
        for bad in ["", "uses:0", "uses:256", "uses:x", "priority:101", "sometimes", "uses"] {
            let e = AdmissionRule::parse(bad).unwrap_err().to_string();
            assert!(e.contains("admission"), "{e}");
        }
    }

    #[test]
    fn after_uses_admits_exactly_on_kth_use_without_collisions() {
        let mut a = Admission::new(AdmissionRule::AfterUses(3), 1024);
        for key in 0..100u64 {
            assert!(!a.offer(&key, 35));
            assert!(!a.offer(&key, 35));
            assert!(a.offer(&key, 35), "key {key} refused on its third use");
        }
    }

    #[test]
    fn sketch_never_undercounts_and_decays() {
        let mut s = FrequencySketch::new(1024);
        for i in 0..5000u64 {
            for _ in 0..(i % 4) {
                s.record(&i);
            }
        }
        // The window (10 * width) was not reached for these counts, so no halving yet for
        // the bound check on a fresh sketch:
        let mut fresh = FrequencySketch::new(1024);
        for i in 0..500u64 {
            for _ in 0..(i % 5) {
                fresh.record(&i);
            }
        }
        for i in 0..500u64 {
            assert!(fresh.estimate(&i) >= (i % 5) as u32);
        }
        // Past the window, everything halves.
        let mut d = FrequencySketch::new(1024);
        for _ in 0..8 {
            d.record(&1u64);
        }
        let before = d.estimate(&1u64);
        for i in 0..(1024 * 10) as u64 {
            d.record(&(i + 1_000_000));
        }
        assert!(d.estimate(&1u64) < before);
    }

    #[test]
    fn min_priority_rule() {
        let mut a = Admission::new(AdmissionRule::MinPriority(50), 0);
        assert!(!a.offer(&1u32, 49));
        assert!(a.offer(&1u32, 50));
    }
}
