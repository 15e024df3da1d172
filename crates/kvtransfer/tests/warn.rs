//! An unrecognised pod label logs a warning, once per distinct value.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::Write;
use std::sync::{Arc, Mutex};

use kvtransfer::Registry;

#[derive(Clone, Default)]
struct Capture(Arc<Mutex<Vec<u8>>>);

impl Write for Capture {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn unrecognised_label_warns_once_per_value() {
    let capture = Capture::default();
    let writer = capture.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::WARN)
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    let registry = Registry::with_builtins();
    tracing::subscriber::with_default(subscriber, || {
        for _ in 0..5 {
            assert_eq!(registry.resolve_connector_type("Bogus-One", "shfs"), "shfs");
        }
        assert_eq!(registry.resolve_connector_type("bogus-two", "nixl"), "nixl");
        // Recognised and empty values never warn.
        assert_eq!(registry.resolve_connector_type("nixl", "shfs"), "nixl");
        assert_eq!(registry.resolve_connector_type("", "shfs"), "shfs");
    });
    let logs = String::from_utf8(capture.0.lock().unwrap().clone()).unwrap();
    let warnings: Vec<&str> = logs.lines().filter(|l| l.contains("WARN")).collect();
    assert_eq!(warnings.len(), 2, "{logs}");
    assert!(warnings[0].contains("Bogus-One"), "{logs}");
    assert!(warnings[1].contains("bogus-two"), "{logs}");
    assert!(
        warnings[0].contains("model.aibrix.ai/kv-connector-type"),
        "{logs}"
    );
}
