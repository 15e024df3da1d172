//! The index's storage: the entry slab, per-endpoint LRU lists, the key postings (chain or
//! bitmap) and the engine-hash table. Hash tables hold `u32` entry indices and compare through
//! the slab.

use super::{
    CHUNK, CHUNK_SHIFT, CacheIndex, Entry, FREE_ENTRY, NIL, Posting, WIDE_AT, WIDE_BIT, Wide, bit,
    folded,
};

/// Entries in fixed chunks: growing never copies or doubles, so memory stays proportional.
/// A chunk is an array, not a slice: the index within it is masked, so reading an entry checks
/// one bound instead of two (every probe, link and walk reads entries).
#[derive(Debug)]
pub(super) struct Slab {
    pub(super) chunks: Vec<Box<[Entry; CHUNK]>>,
    free: u32,
    used: u32,
}

impl Slab {
    pub(super) fn new() -> Self {
        Self {
            chunks: Vec::new(),
            free: NIL,
            used: 0,
        }
    }

    pub(super) fn get(&self, i: u32) -> &Entry {
        &self.chunks[(i >> CHUNK_SHIFT) as usize][i as usize & (CHUNK - 1)]
    }
    /// Slot `i`, if the slab has grown that far (it may be free: [`super::FREE_KIND`]).
    pub(super) fn try_get(&self, i: u32) -> Option<&Entry> {
        self.chunks
            .get((i >> CHUNK_SHIFT) as usize)
            .map(|c| &c[i as usize & (CHUNK - 1)])
    }
    pub(super) fn get_mut(&mut self, i: u32) -> &mut Entry {
        &mut self.chunks[(i >> CHUNK_SHIFT) as usize][i as usize & (CHUNK - 1)]
    }
    pub(super) fn alloc(&mut self, e: Entry) -> u32 {
        if self.free != NIL {
            let i = self.free;
            self.free = self.get(i).next;
            *self.get_mut(i) = e;
            return i;
        }
        let i = self.used;
        if i as usize == self.chunks.len() * CHUNK {
            let chunk: Box<[Entry; CHUNK]> = vec![FREE_ENTRY; CHUNK]
                .into_boxed_slice()
                .try_into()
                .expect("a chunk of CHUNK entries");
            self.chunks.push(chunk);
        }
        self.used += 1;
        *self.get_mut(i) = e;
        i
    }
    pub(super) fn release(&mut self, i: u32) {
        let free = self.free;
        *self.get_mut(i) = Entry {
            next: free,
            ..FREE_ENTRY
        };
        self.free = i;
    }
}

impl Wide {
    /// Marks endpoint `ep` as holding the key.
    fn add(&mut self, ep: usize) {
        if self.bits.len() <= ep / 64 {
            self.bits.resize(ep / 64 + 1, 0);
        }
        self.bits[ep / 64] |= 1 << (ep % 64);
        self.count += 1;
    }
}

impl CacheIndex {
    // --- LRU lists ----------------------------------------------------------------------------

    pub(super) fn link_front(&mut self, i: u32) {
        let e = *self.slab.get(i);
        let list = &mut self.endpoints[usize::from(e.endpoint)].lists[usize::from(e.kind)];
        let old = list.head;
        list.head = i;
        if list.tail == NIL {
            list.tail = i;
        }
        list.len += 1;
        let entry = self.slab.get_mut(i);
        entry.prev = NIL;
        entry.next = old;
        if old != NIL {
            self.slab.get_mut(old).prev = i;
        }
    }

    pub(super) fn unlink(&mut self, i: u32) {
        let e = *self.slab.get(i);
        let list = &mut self.endpoints[usize::from(e.endpoint)].lists[usize::from(e.kind)];
        if e.prev == NIL {
            list.head = e.next;
        }
        if e.next == NIL {
            list.tail = e.prev;
        }
        list.len -= 1;
        if e.prev != NIL {
            self.slab.get_mut(e.prev).next = e.next;
        }
        if e.next != NIL {
            self.slab.get_mut(e.next).prev = e.prev;
        }
    }

    // --- postings -----------------------------------------------------------------------------

    pub(super) fn posting_key(slab: &Slab, wides: &[Wide], v: u32) -> u64 {
        if v & WIDE_BIT != 0 {
            wides[(v & !WIDE_BIT) as usize].key
        } else {
            slab.get(v).key
        }
    }

    pub(super) fn posting(&self, key: u64) -> Option<Posting<'_>> {
        self.posting_value(key).map(|v| self.posting_of(v))
    }

    /// `key`'s posting as the table stores it (see [`CacheIndex::posting_of`]).
    #[inline]
    pub(super) fn posting_value(&self, key: u64) -> Option<u32> {
        let (slab, wides) = (&self.slab, &self.wides);
        self.posting
            .find(self.h1(key), |&v| Self::posting_key(slab, wides, v) == key)
            .copied()
    }

    /// The posting a stored value names.
    #[inline]
    pub(super) fn posting_of(&self, v: u32) -> Posting<'_> {
        if v & WIDE_BIT != 0 {
            Posting::Wide(&self.wides[(v & !WIDE_BIT) as usize])
        } else {
            Posting::Narrow(v)
        }
    }

    pub(super) fn set_posting(&mut self, key: u64, value: Option<u32>) {
        let h = self.h1(key);
        let seed = self.seed;
        let (slab, wides) = (&self.slab, &self.wides);
        match self
            .posting
            .find_entry(h, |&v| Self::posting_key(slab, wides, v) == key)
        {
            Ok(mut occ) => match value {
                Some(v) => *occ.get_mut() = v,
                None => {
                    occ.remove();
                }
            },
            Err(_) => {
                if let Some(v) = value {
                    self.posting.insert_unique(h, v, |&v| {
                        folded(
                            Self::posting_key(slab, wides, v) ^ seed,
                            0x9e37_79b9_7f4a_7c15,
                        )
                    });
                }
            }
        }
    }

    pub(super) fn wide_entry_insert(&mut self, i: u32) {
        let e = self.slab.get(i);
        let h = self.h2(e.key, e.endpoint);
        let (slab, seed) = (&self.slab, self.seed);
        self.wide_entries.insert_unique(h, i, |&j| {
            let e = slab.get(j);
            folded(
                e.key ^ seed,
                0x9e37_79b9_7f4a_7c15 ^ (u64::from(e.endpoint) << 1),
            )
        });
    }

    pub(super) fn wide_entry_remove(&mut self, i: u32) {
        let e = self.slab.get(i);
        let h = self.h2(e.key, e.endpoint);
        if let Ok(occ) = self.wide_entries.find_entry(h, |&j| j == i) {
            occ.remove();
        }
    }

    /// The entry (key, ep) among `key`'s posting.
    pub(super) fn find_in(&self, posting: Posting<'_>, key: u64, ep: u16) -> Option<u32> {
        match posting {
            Posting::Narrow(mut i) => {
                while i != NIL {
                    let e = self.slab.get(i);
                    if e.endpoint == ep {
                        return Some(i);
                    }
                    i = e.key_next;
                }
                None
            }
            Posting::Wide(w) => {
                if !bit(&w.bits, ep) {
                    return None;
                }
                let slab = &self.slab;
                self.wide_entries
                    .find(self.h2(key, ep), |&j| {
                        let e = slab.get(j);
                        e.key == key && e.endpoint == ep
                    })
                    .copied()
            }
        }
    }

    /// Posts entry `i` under its key, which has no posting yet (the caller just looked).
    pub(super) fn posting_insert_new(&mut self, i: u32) {
        let key = {
            let e = self.slab.get_mut(i);
            e.key_next = NIL;
            e.key
        };
        let h = self.h1(key);
        let seed = self.seed;
        let (slab, wides) = (&self.slab, &self.wides);
        self.posting.insert_unique(h, i, |&v| {
            folded(
                Self::posting_key(slab, wides, v) ^ seed,
                0x9e37_79b9_7f4a_7c15,
            )
        });
    }

    /// Posts entry `i` under its key, wherever the key's posting stands.
    pub(super) fn posting_add(&mut self, i: u32) {
        let key = self.slab.get(i).key;
        match self.posting(key) {
            None => self.posting_insert_new(i),
            Some(Posting::Narrow(head)) => {
                self.posting_after(head, i);
            }
            Some(Posting::Wide(_)) => self.wide_add(i),
        }
    }

    /// Posts entry `i` on the narrow chain starting at `head`, its key's posting: right after
    /// the head, so the posting table is not touched; a chain of [`WIDE_AT`] becomes a bitmap.
    /// Returns whether the key is still narrow (with `head` its chain's head).
    pub(super) fn posting_after(&mut self, head: u32, i: u32) -> bool {
        let mut len = 0;
        let mut j = head;
        while j != NIL {
            len += 1;
            j = self.slab.get(j).key_next;
        }
        if len < WIDE_AT {
            let next = self.slab.get(head).key_next;
            self.slab.get_mut(i).key_next = next;
            self.slab.get_mut(head).key_next = i;
            return true;
        }
        self.widen(head, i);
        false
    }

    /// Turns the narrow chain at `head` plus entry `i` into a bitmap posting.
    fn widen(&mut self, head: u32, i: u32) {
        let key = self.slab.get(i).key;
        let mut chain = Vec::with_capacity(WIDE_AT + 1);
        let mut j = head;
        while j != NIL {
            chain.push(j);
            j = self.slab.get(j).key_next;
        }
        chain.push(i);
        let mut wide = Wide {
            key,
            bits: Vec::new(),
            count: 0,
        };
        for &j in &chain {
            let e = self.slab.get_mut(j);
            e.key_next = NIL;
            wide.add(usize::from(e.endpoint));
        }
        let w = match self.free_wides.pop() {
            Some(w) => {
                self.wides[w as usize] = wide;
                w
            }
            None => {
                self.wides.push(wide);
                (self.wides.len() - 1) as u32
            }
        };
        self.set_posting(key, Some(w | WIDE_BIT));
        for j in chain {
            self.wide_entry_insert(j);
        }
    }

    /// Adds entry `i` to its key's bitmap posting.
    fn wide_add(&mut self, i: u32) {
        let (key, ep) = {
            let e = self.slab.get_mut(i);
            e.key_next = NIL;
            (e.key, usize::from(e.endpoint))
        };
        let w = self.wide_index(key);
        self.wides[w].add(ep);
        self.wide_entry_insert(i);
    }

    pub(super) fn wide_index(&self, key: u64) -> usize {
        let (slab, wides) = (&self.slab, &self.wides);
        self.posting
            .find(self.h1(key), |&v| Self::posting_key(slab, wides, v) == key)
            .map_or(usize::MAX, |&v| (v & !WIDE_BIT) as usize)
    }

    pub(super) fn posting_remove(&mut self, i: u32) {
        let e = *self.slab.get(i);
        match self.posting(e.key) {
            None => {}
            Some(Posting::Narrow(head)) => {
                if head == i {
                    self.set_posting(e.key, (e.key_next != NIL).then_some(e.key_next));
                    return;
                }
                let mut j = head;
                while j != NIL {
                    let next = self.slab.get(j).key_next;
                    if next == i {
                        self.slab.get_mut(j).key_next = e.key_next;
                        return;
                    }
                    j = next;
                }
            }
            Some(Posting::Wide(_)) => {
                let w = self.wide_index(e.key);
                self.wide_entry_remove(i);
                let wide = &mut self.wides[w];
                let ep = usize::from(e.endpoint);
                if let Some(word) = wide.bits.get_mut(ep / 64) {
                    *word &= !(1 << (ep % 64));
                }
                wide.count -= 1;
                if wide.count == 0 {
                    // The posting must go while its key is still readable in `wides`.
                    self.set_posting(e.key, None);
                    self.wides[w] = Wide {
                        key: 0,
                        bits: Vec::new(),
                        count: 0,
                    };
                    self.free_wides.push(w as u32);
                }
            }
        }
    }

    pub(super) fn engine_find(&self, engine: u64, ep: u16) -> Option<u32> {
        let slab = &self.slab;
        self.engine
            .find(self.h2(engine, ep), |&j| {
                let e = slab.get(j);
                e.engine == engine && e.endpoint == ep
            })
            .copied()
    }

    pub(super) fn engine_insert(&mut self, i: u32) {
        let e = self.slab.get(i);
        let h = self.h2(e.engine, e.endpoint);
        let (slab, seed) = (&self.slab, self.seed);
        self.engine.insert_unique(h, i, |&j| {
            let e = slab.get(j);
            folded(
                e.engine ^ seed,
                0x9e37_79b9_7f4a_7c15 ^ (u64::from(e.endpoint) << 1),
            )
        });
    }

    pub(super) fn engine_remove(&mut self, i: u32) {
        let e = self.slab.get(i);
        let h = self.h2(e.engine, e.endpoint);
        if let Ok(occ) = self.engine.find_entry(h, |&j| j == i) {
            occ.remove();
        }
    }
}
