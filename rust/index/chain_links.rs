//! Which resident block extends which, for the policies that may evict only leaves
//! (`EvictionPolicy::leaves_only`).
//!
//! Why: a block is reachable only through its prefix, so evicting a block that a resident block
//! extends leaves that block cached and unreachable: a slot spent on nothing. Recency policies
//! avoid it by the order alone (a chain is applied tail first, so its head is the more recent),
//! but a policy that ranks by learned value may rank a chain's head below its tail. For those
//! the index keeps, per slot, the block it extends (its parent: the block before it in the
//! store that placed it) and how many resident blocks extend it, and offers only blocks that
//! nothing extends (the planner's prefix-tree rule).
//!
//! A parent link names the parent's slot and generation; a link whose parent has left (removed,
//! failed store, slot reused) is dead and changes no count. All of it is writers' state, under
//! the index's mutex.

use super::entry_state::{BlockState, EntryState};

const NONE: u32 = u32::MAX;

pub(super) struct ChainLinks {
    /// Slot of the block each slot's block extends, or NONE.
    parent: Box<[u32]>,
    /// Generation of that parent when the link was made.
    parent_generation: Box<[u32]>,
    /// How many resident blocks extend each slot's block.
    children: Box<[u32]>,
}

impl ChainLinks {
    pub fn new(capacity: usize) -> Self {
        ChainLinks {
            parent: vec![NONE; capacity].into(),
            parent_generation: vec![0; capacity].into(),
            children: vec![0; capacity].into(),
        }
    }

    /// A new block took `slot`: it extends nothing and nothing extends it yet.
    pub fn occupied(&mut self, slot: u32) {
        self.parent[slot as usize] = NONE;
        self.children[slot as usize] = 0;
    }

    /// The block in `child` extends the block of `generation` in `parent`.
    pub fn link(&mut self, child: u32, parent: u32, generation: u32) {
        self.parent[child as usize] = parent;
        self.parent_generation[child as usize] = generation;
        self.children[parent as usize] += 1;
    }

    /// The slot of the block that `slot`'s block extends, if that block is still there (its
    /// slot neither vacant nor reused since the link was made).
    fn live_parent(&self, slot: u32, states: &[EntryState]) -> Option<u32> {
        let parent = self.parent[slot as usize];
        if parent == NONE {
            return None;
        }
        let (state, _, generation) = states[parent as usize].load_with_generation();
        (state != BlockState::Evicting && generation == self.parent_generation[slot as usize]).then_some(parent)
    }

    /// The block in `slot` left: its parent, if still the one it extended, loses a child.
    pub fn left(&mut self, slot: u32, states: &[EntryState]) {
        if let Some(parent) = self.live_parent(slot, states) {
            self.children[parent as usize] -= 1;
        }
        self.parent[slot as usize] = NONE;
    }

    pub fn is_leaf(&self, slot: u32) -> bool {
        self.children[slot as usize] == 0
    }

    /// How many of the resident blocks (`resident`) could leave, leaves first, if each leaf in
    /// turn that `evictable` allows were evicted: those with no blocked block below them. A
    /// block is blocked when `evictable` refuses it, and so is every block it extends, up to
    /// the root. O(capacity): only for a store that the leaves alone cannot make room for.
    pub fn peelable(
        &self,
        resident: impl Fn(u32) -> bool,
        evictable: impl Fn(u32) -> bool,
        states: &[EntryState],
    ) -> usize {
        let n = self.parent.len();
        let mut blocked = vec![false; n];
        for slot in 0..n as u32 {
            if !resident(slot) || evictable(slot) {
                continue;
            }
            let mut at = slot;
            loop {
                if blocked[at as usize] {
                    break;
                }
                blocked[at as usize] = true;
                match self.live_parent(at, states) {
                    Some(p) => at = p,
                    None => break,
                }
            }
        }
        (0..n as u32).filter(|&s| resident(s) && !blocked[s as usize]).count()
    }
}
