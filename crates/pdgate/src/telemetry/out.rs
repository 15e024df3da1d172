//! Where the text and JSON logs go: standard output, one `write` per line, except while a
//! [`Batch`] is open on the writing thread, when lines are collected and written together as it
//! closes. The access-log writer opens one around each drain of its queue: one system call per
//! drain instead of one per request (see docs/benchmarks.md).

use std::cell::RefCell;
use std::io::{self, Write};

use tracing_subscriber::fmt::MakeWriter;

/// Bytes collected before a batch writes early: bounds the buffer when a drain is long.
const BATCH_BYTES: usize = 64 * 1024;

thread_local! {
    /// The open batch on this thread, if any.
    static BATCH: RefCell<Option<Vec<u8>>> = const { RefCell::new(None) };
}

/// Collects the log lines this thread writes while it lives; writes them in one go when
/// dropped. Not held across an `.await` (the lines of another task on this thread would join
/// it, and the batch would end on whichever thread the task resumed on). Opened inside another,
/// it joins it (its drop writes what both collected so far).
#[derive(Debug)]
pub(crate) struct Batch(());

impl Batch {
    pub(crate) fn open() -> Self {
        BATCH.with(|b| {
            b.borrow_mut().get_or_insert_with(Vec::new);
        });
        Batch(())
    }
}

impl Drop for Batch {
    fn drop(&mut self) {
        if let Some(buf) = BATCH.with(|b| b.borrow_mut().take()) {
            write_out(&buf);
        }
    }
}

/// Writes `buf` to standard output; a log line that cannot be written is lost, as with any
/// logger writing to a closed stream.
fn write_out(buf: &[u8]) {
    if !buf.is_empty() {
        let _ = io::stdout().lock().write_all(buf);
    }
}

/// Writes a rendered log line (or lines) as the logs' writer does: into this thread's open
/// [`Batch`], else to standard output.
pub(crate) fn write_log(line: &[u8]) {
    let _ = LogOut.write_all(line);
}

/// The logs' writer (`MakeWriter`): standard output, through the thread's open [`Batch`].
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct LogOut;

impl<'a> MakeWriter<'a> for LogOut {
    type Writer = LogOut;

    fn make_writer(&'a self) -> Self::Writer {
        LogOut
    }
}

impl Write for LogOut {
    fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
        let rest = BATCH.with(|b| {
            let mut b = b.borrow_mut();
            let buf = b.as_mut()?;
            buf.extend_from_slice(bytes);
            if buf.len() >= BATCH_BYTES {
                write_out(buf);
                buf.clear();
            }
            Some(())
        });
        match rest {
            Some(()) => Ok(bytes.len()),
            None => io::stdout().write(bytes),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        let batching = BATCH.with(|b| b.borrow().is_some());
        if batching {
            Ok(())
        } else {
            io::stdout().flush()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_collects_the_threads_lines_until_it_closes() {
        let batch = Batch::open();
        LogOut.write_all(b"one\n").expect("collected");
        LogOut.write_all(b"two\n").expect("collected");
        let held = BATCH.with(|b| b.borrow().clone());
        assert_eq!(held.as_deref(), Some(&b"one\ntwo\n"[..]));
        // Another thread has no batch open: its lines are not collected here.
        std::thread::spawn(|| assert!(BATCH.with(|b| b.borrow().is_none())))
            .join()
            .expect("thread");
        drop(batch);
        assert!(BATCH.with(|b| b.borrow().is_none()), "closed and written");
    }
}
