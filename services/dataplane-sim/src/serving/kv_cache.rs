//! A replica's paged KV cache with automatic prefix caching ([`KvCache`]), the blocks one
//! request holds ([`Alloc`]) and the bounded LRU set of block hashes ([`Lru`]) it keeps its
//! reusable blocks in (the endpoint picker's prefix index uses one too). Block bookkeeping
//! only: the engine decides when to allocate, commit and release.

use std::collections::{BTreeMap, HashMap};

/// A set of block hashes in least-recently-used order, bounded by a capacity.
#[derive(Debug, Default)]
pub struct Lru {
    capacity: usize,
    clock: u64,
    by_hash: HashMap<u64, u64>,
    by_age: BTreeMap<u64, u64>,
    evicted: u64,
}

impl Lru {
    pub fn new(capacity: usize) -> Lru {
        Lru {
            capacity: capacity.max(1),
            ..Default::default()
        }
    }

    pub fn set_capacity(&mut self, capacity: usize) {
        self.capacity = capacity.max(1);
        while self.by_hash.len() > self.capacity {
            self.pop_oldest();
        }
    }

    pub fn len(&self) -> usize {
        self.by_hash.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_hash.is_empty()
    }

    pub fn contains(&self, h: u64) -> bool {
        self.by_hash.contains_key(&h)
    }

    /// Inserts `h` or makes it the most recent; the oldest goes when the set is full.
    pub fn touch(&mut self, h: u64) {
        self.clock += 1;
        if let Some(old) = self.by_hash.insert(h, self.clock) {
            self.by_age.remove(&old);
        }
        self.by_age.insert(self.clock, h);
        while self.by_hash.len() > self.capacity {
            self.pop_oldest();
        }
    }

    pub fn remove(&mut self, h: u64) -> bool {
        match self.by_hash.remove(&h) {
            Some(age) => {
                self.by_age.remove(&age);
                true
            }
            None => false,
        }
    }

    pub fn pop_oldest(&mut self) -> Option<u64> {
        let (_, h) = self.by_age.pop_first()?;
        self.by_hash.remove(&h);
        self.evicted += 1;
        Some(h)
    }
}

/// KV blocks held by one request: the cached blocks it references and the blocks of its own
/// not (yet) in the cache.
#[derive(Debug, Default)]
pub(super) struct Alloc {
    pub(super) pinned: Vec<u64>,
    private: usize,
}

/// A replica's paged KV cache with automatic prefix caching.
#[derive(Debug)]
pub(super) struct KvCache {
    pub(super) capacity: usize,
    /// Blocks requests hold that are not cached blocks.
    held: usize,
    /// Cached full blocks and how many running requests use each.
    refs: HashMap<u64, u32>,
    /// Cached blocks no request uses: reusable, evicted oldest first.
    free: Lru,
    pub(super) evictions: u64,
}

impl KvCache {
    pub(super) fn new(capacity: usize) -> KvCache {
        KvCache {
            capacity,
            held: 0,
            refs: HashMap::new(),
            free: Lru::new(usize::MAX),
            evictions: 0,
        }
    }

    /// Blocks in use by running requests.
    fn used(&self) -> usize {
        self.held + self.refs.len() - self.free.len()
    }

    pub(super) fn usage(&self) -> f64 {
        (self.used() as f64 / self.capacity as f64).min(1.0)
    }

    fn matched(&self, hashes: &[u64]) -> usize {
        hashes
            .iter()
            .take_while(|h| self.refs.contains_key(h))
            .count()
    }

    /// Reserves `total` blocks for a request whose first full blocks are `hashes`, reusing the
    /// cached run at their head (at most `max_match` blocks). `None`: not enough room now.
    pub(super) fn allocate(
        &mut self,
        hashes: &[u64],
        max_match: usize,
        total: usize,
    ) -> Option<Alloc> {
        let m = self.matched(hashes).min(max_match).min(total);
        let reused_free = hashes[..m]
            .iter()
            .filter(|h| self.free.contains(**h))
            .count();
        let new = total - m;
        let never_used = self.capacity.saturating_sub(self.held + self.refs.len());
        if never_used + self.free.len() - reused_free < new {
            return None;
        }
        for h in &hashes[..m] {
            *self.refs.get_mut(h).expect("matched") += 1;
            self.free.remove(*h);
        }
        for _ in 0..new.saturating_sub(never_used) {
            let h = self.free.pop_oldest().expect("room was counted");
            self.refs.remove(&h);
            self.evictions += 1;
        }
        self.held += new;
        Some(Alloc {
            pinned: hashes[..m].to_vec(),
            private: new,
        })
    }

    /// Turns a request's computed full blocks (`hashes`, its whole chain so far) into cached ones.
    pub(super) fn commit(&mut self, a: &mut Alloc, hashes: &[u64]) {
        for h in hashes.iter().skip(a.pinned.len()) {
            if a.private == 0 {
                break;
            }
            match self.refs.get_mut(h) {
                Some(r) => {
                    *r += 1;
                    self.free.remove(*h);
                }
                None => {
                    self.refs.insert(*h, 1);
                }
            }
            self.held -= 1;
            a.private -= 1;
            a.pinned.push(*h);
        }
    }

    /// Gives a finished request's blocks back: its cached ones stay reusable, the tail first
    /// in line for eviction.
    pub(super) fn release(&mut self, a: Alloc) {
        for h in a.pinned.iter().rev() {
            let r = self.refs.get_mut(h).expect("pinned");
            *r -= 1;
            if *r == 0 {
                self.free.touch(*h);
            }
        }
        self.held -= a.private;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kv_cache_reuses_prefixes_and_evicts_least_recently_used() {
        let mut kv = KvCache::new(10);
        let a = [1, 2, 3, 4];
        let mut x = kv.allocate(&a, 4, 5).unwrap();
        assert_eq!((x.pinned.len(), x.private), (0, 5));
        kv.commit(&mut x, &a);
        assert_eq!(kv.used(), 5);
        kv.release(x);
        assert_eq!(kv.used(), 0);
        assert_eq!(kv.free.len(), 4, "the 4 full blocks stay cached");
        // Same prefix: 3 of its blocks reused (at most max_match).
        let y = kv.allocate(&a, 3, 5).unwrap();
        assert_eq!((y.pinned.len(), y.private), (3, 2));
        // Not enough room for 9 more blocks while y runs: wait.
        assert!(kv.allocate(&[9], 0, 9).is_none());
        kv.release(y);
        // Another request needing 8 blocks: 6 never used plus 2 evicted, tail (4, 3) first.
        let z = kv.allocate(&[7], 0, 8).unwrap();
        assert_eq!(kv.evictions, 2);
        assert!(kv.refs.contains_key(&1) && kv.refs.contains_key(&2));
        assert!(!kv.refs.contains_key(&4) && !kv.refs.contains_key(&3));
        kv.release(z);
        assert_eq!(kv.used(), 0);
    }

    #[test]
    fn lru_is_bounded() {
        let mut l = Lru::new(2);
        l.touch(1);
        l.touch(2);
        l.touch(1);
        l.touch(3);
        assert!(l.contains(1) && l.contains(3) && !l.contains(2));
        l.set_capacity(1);
        assert!(l.contains(3) && !l.contains(1));
    }
}
