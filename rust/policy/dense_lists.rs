//! Doubly linked lists threaded through one array indexed by each key's dense id
//! (`PolicyKey::dense_id`: the index's slot number, the planner's prefix-tree node id).
//!
//! This is what the LRU, FIFO, ARC and S3-FIFO policies order their resident keys with, in
//! place of a linked hash map (hashlink's `LinkedHashMap`), which hashes the key on every
//! operation and allocates a node per block: ~68 bytes a resident block and a hash lookup per
//! insert, touch, removal and victim. Here a key's node sits at its dense id, so every
//! operation is a few array accesses, and each id costs one node up front (32 bytes for the
//! index's keys, one per slot; 16 for the planner's). A node also holds a spare word for the
//! policy, of its choosing: a byte by default (S3-FIFO keeps its use counter there), a u32 for
//! hit density's time stamp (in what is padding of the index's nodes: still 32 bytes).
//!
//! Dense ids must be unique among the keys listed at one time, below u32::MAX, and should be
//! small (the array grows to the largest id seen). Listing a key that is already listed is a
//! caller bug, and panics rather than cut a list (the index then fails closed).

const NIL: u32 = u32::MAX;
const UNLISTED: u8 = u8::MAX;

#[derive(Clone, Copy)]
struct Node<K, A> {
    key: K,
    prev: u32,
    next: u32,
    /// Which list the key is on, or UNLISTED.
    list: u8,
    aux: A,
}

#[derive(Clone, Copy)]
struct Ends {
    head: u32,
    tail: u32,
    len: usize,
}

const EMPTY: Ends = Ends { head: NIL, tail: NIL, len: 0 };

/// `N` lists (front = oldest) over keys of type `K`, each key on at most one of them.
pub struct DenseLists<K, const N: usize, A = u8> {
    nodes: Vec<Node<K, A>>,
    ends: [Ends; N],
}

/// Where a key lives, for `DenseLists`.
pub trait DenseId: Copy + Default {
    fn dense_id(&self) -> u32;
}

impl<K: DenseId, const N: usize, A: Copy + Default> DenseLists<K, N, A> {
    /// Lists whose array is sized for dense ids below `ids` up front (it grows past that on
    /// demand: sizing it now keeps a tier's stores from reallocating it midway).
    pub fn with_ids(ids: usize) -> Self {
        assert!(N < UNLISTED as usize, "too many lists");
        DenseLists { nodes: vec![Self::unlisted(); ids], ends: [EMPTY; N] }
    }

    fn unlisted() -> Node<K, A> {
        Node { key: K::default(), prev: NIL, next: NIL, list: UNLISTED, aux: A::default() }
    }

    fn node(&self, key: &K) -> Option<&Node<K, A>> {
        self.nodes.get(key.dense_id() as usize).filter(|n| n.list != UNLISTED)
    }

    /// The list `key` is on, if any.
    #[inline]
    pub fn list_of(&self, key: &K) -> Option<usize> {
        self.node(key).map(|n| n.list as usize)
    }

    pub fn len(&self, list: usize) -> usize {
        self.ends[list].len
    }

    /// Append `key` (on no list) at the back of `list`, with `aux`.
    pub fn push_back(&mut self, list: usize, key: K, aux: A) {
        let id = key.dense_id();
        let i = id as usize;
        if i >= self.nodes.len() {
            self.nodes.resize((i + 1).max(self.nodes.len() * 2), Self::unlisted());
        }
        assert!(id != NIL, "dense id u32::MAX is reserved");
        assert_eq!(self.nodes[i].list, UNLISTED, "key {id} listed twice");
        let ends = &mut self.ends[list];
        self.nodes[i] = Node { key, prev: ends.tail, next: NIL, list: list as u8, aux };
        match ends.tail {
            NIL => ends.head = id,
            tail => self.nodes[tail as usize].next = id,
        }
        ends.tail = id;
        ends.len += 1;
    }

    /// Put `key` (on no list) just ahead of `at` on `at`'s list, with `aux`; at the back of
    /// `list` when `at` is on none.
    pub fn insert_before(&mut self, list: usize, key: K, at: &K, aux: A) {
        let Some(next) = self.node(at).copied() else {
            return self.push_back(list, key, aux);
        };
        let (at_id, list) = (at.dense_id(), next.list as usize);
        // Appended, then moved into place: the growth and the "listed twice" checks are push_back's.
        self.push_back(list, key, aux);
        let id = key.dense_id();
        // Off the back (it is the tail, with `at` before it somewhere)...
        let prev = self.nodes[id as usize].prev;
        self.nodes[prev as usize].next = NIL;
        self.ends[list].tail = prev;
        // ...and in between `at`'s predecessor and `at`.
        let before = self.nodes[at_id as usize].prev;
        self.nodes[id as usize].prev = before;
        self.nodes[id as usize].next = at_id;
        self.nodes[at_id as usize].prev = id;
        match before {
            NIL => self.ends[list].head = id,
            b => self.nodes[b as usize].next = id,
        }
    }

    /// Take `key` off its list; its list and aux, or None if it was on none.
    pub fn unlink(&mut self, key: &K) -> Option<(usize, A)> {
        let n = *self.node(key)?;
        let list = n.list as usize;
        match n.prev {
            NIL => self.ends[list].head = n.next,
            p => self.nodes[p as usize].next = n.next,
        }
        match n.next {
            NIL => self.ends[list].tail = n.prev,
            x => self.nodes[x as usize].prev = n.prev,
        }
        self.ends[list].len -= 1;
        self.nodes[key.dense_id() as usize] = Self::unlisted();
        Some((list, n.aux))
    }

    /// Move `key` to the back of the list it is on (nothing if it is on none).
    pub fn move_to_back(&mut self, key: &K) {
        if let Some((list, aux)) = self.unlink(key) {
            self.push_back(list, *key, aux);
        }
    }

    /// The spare word of `key`, if it is listed.
    pub fn aux_mut(&mut self, key: &K) -> Option<&mut A> {
        self.nodes.get_mut(key.dense_id() as usize).filter(|n| n.list != UNLISTED).map(|n| &mut n.aux)
    }

    /// `list`'s keys with their spare words, front (oldest) to back.
    pub fn iter(&self, list: usize) -> impl Iterator<Item = (K, A)> + '_ {
        let mut at = self.ends[list].head;
        std::iter::from_fn(move || {
            if at == NIL {
                return None;
            }
            let n = &self.nodes[at as usize];
            at = n.next;
            Some((n.key, n.aux))
        })
    }

    /// `list`'s keys, front to back.
    pub fn keys(&self, list: usize) -> impl Iterator<Item = K> + '_ {
        self.iter(list).map(|(k, _)| k)
    }

    /// Empty every list (the array keeps its size).
    pub fn clear(&mut self) {
        self.nodes.fill(Self::unlisted());
        self.ends = [EMPTY; N];
    }
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;

    use proptest::prelude::*;

    use super::*;

    #[derive(Clone, Debug)]
    enum Op {
        Push(usize, u32, u8),
        Unlink(u32),
        ToBack(u32),
        Before(u32, u32, u8),
        SetAux(u32, u8),
        Clear,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (0usize..3, 0u32..40, any::<u8>()).prop_map(|(l, k, a)| Op::Push(l, k, a)),
            2 => (0u32..40).prop_map(Op::Unlink),
            2 => (0u32..40).prop_map(Op::ToBack),
            3 => (0u32..40, 0u32..40, any::<u8>()).prop_map(|(k, at, a)| Op::Before(k, at, a)),
            1 => (0u32..40, any::<u8>()).prop_map(|(k, a)| Op::SetAux(k, a)),
            1 => Just(Op::Clear),
        ]
    }

    #[test]
    #[should_panic(expected = "listed twice")]
    fn listing_a_listed_key_again_panics_instead_of_cutting_its_list() {
        let mut lists: DenseLists<u32, 2> = DenseLists::with_ids(4);
        for k in 0..3 {
            lists.push_back(0, k, 0);
        }
        lists.push_back(1, 1, 0);
    }

    proptest! {
        /// Three lists against three VecDeques of (key, aux): same contents, order and lengths
        /// after every operation (the array starts small, so growth is exercised too).
        #[test]
        fn matches_a_model_of_deques(ops in proptest::collection::vec(op(), 1..200)) {
            let mut lists: DenseLists<u32, 3> = DenseLists::with_ids(4);
            let mut model: [VecDeque<(u32, u8)>; 3] = Default::default();
            let find = |m: &[VecDeque<(u32, u8)>; 3], k: u32| {
                (0..3).find_map(|l| m[l].iter().position(|&(x, _)| x == k).map(|p| (l, p)))
            };
            for op in ops {
                match op {
                    Op::Push(l, k, a) => {
                        if find(&model, k).is_none() {
                            lists.push_back(l, k, a);
                            model[l].push_back((k, a));
                        }
                    }
                    Op::Unlink(k) => {
                        let want = find(&model, k).map(|(l, p)| (l, model[l].remove(p).unwrap().1));
                        prop_assert_eq!(lists.unlink(&k), want);
                    }
                    Op::ToBack(k) => {
                        lists.move_to_back(&k);
                        if let Some((l, p)) = find(&model, k) {
                            let e = model[l].remove(p).unwrap();
                            model[l].push_back(e);
                        }
                    }
                    Op::Before(k, at, a) => {
                        if find(&model, k).is_none() {
                            // On `at`'s list just ahead of it; list 0's back when `at` is unlisted.
                            lists.insert_before(0, k, &at, a);
                            match find(&model, at) {
                                Some((l, p)) => model[l].insert(p, (k, a)),
                                None => model[0].push_back((k, a)),
                            }
                        }
                    }
                    Op::SetAux(k, a) => {
                        if let Some(x) = lists.aux_mut(&k) {
                            *x = a;
                        }
                        if let Some((l, p)) = find(&model, k) {
                            model[l][p].1 = a;
                        }
                    }
                    Op::Clear => {
                        lists.clear();
                        model = Default::default();
                    }
                }
                for (l, want) in model.iter().enumerate() {
                    prop_assert_eq!(lists.iter(l).collect::<Vec<_>>(), want.iter().copied().collect::<Vec<_>>());
                    prop_assert_eq!(lists.len(l), want.len());
                }
                for k in 0..40u32 {
                    prop_assert_eq!(lists.list_of(&k), find(&model, k).map(|(l, _)| l));
                }
            }
        }
    }
}
