//! pdcache: what pdgate and pdsim need to know about engines' prefix caches.
