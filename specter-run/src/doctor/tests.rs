//! Parsing of the host figures `doctor` reads, and its text report.

use super::*;

#[test]
fn meminfo_fields_parse_in_bytes() {
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    let total: u64 = rng.random_range(1_000_000..100_000_000);
    let avail: u64 = rng.random_range(1..total);
    let text = format!(
        "MemTotal:       {total} kB\nMemFree:        {} kB\nMemAvailable:   {avail} kB\nBuffers:  12 kB\n",
        avail / 2
    );
    let m = parse_meminfo(&text);
    assert_eq!(m.total_bytes, Some(total * 1024));
    assert_eq!(m.available_bytes, Some(avail * 1024));
    // A field name that is only a prefix of another must not match it.
    let m = parse_meminfo(&format!("MemTotalX: 5 kB\nMemTotal: {total} kB\n"));
    assert_eq!(m.total_bytes, Some(total * 1024));
    assert_eq!(parse_meminfo("MemTotal: lots kB\n").total_bytes, None);
}

#[test]
fn checksum_weights_positions() {
    let mut rng = ChaCha8Rng::seed_from_u64(12);
    let mut bytes = vec![0u8; 4096];
    rng.fill_bytes(&mut bytes);
    let reference: u64 = bytes
        .iter()
        .enumerate()
        .map(|(i, &b)| b as u64 * ((i % 251) as u64 + 1))
        .sum();
    assert_eq!(byte_checksum(&bytes), reference);
    // Swapping two different bytes changes the sum (a plain byte sum would not notice).
    let (i, j) = (3usize, 700usize);
    if bytes[i] == bytes[j] {
        bytes[j] = bytes[j].wrapping_add(1);
    }
    let before = byte_checksum(&bytes);
    bytes.swap(i, j);
    assert_ne!(byte_checksum(&bytes), before);
}

#[test]
fn median_of_odd_and_even_counts() {
    assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
    assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), 2.5);
    assert_eq!(median(&[f64::NAN, 5.0]), 5.0);
    assert_eq!(median(&[]), 0.0);
}

#[test]
fn disk_free_is_reported_for_the_temp_dir() {
    let free = disk_free_bytes(&std::env::temp_dir());
    assert!(
        free.is_some_and(|b| b > 0),
        "statvfs on the temp dir: {free:?}"
    );
    assert_eq!(
        disk_free_bytes(Path::new("/definitely/not/a/dir/here")),
        None
    );
}

#[test]
fn the_text_report_names_the_hybrid_ceiling_beside_the_host_read_bandwidth() {
    let dir = tempfile::tempdir().unwrap();
    let opts = DoctorOptions {
        gpu: false,
        work_dir: dir.path().to_path_buf(),
        temp_dir: dir.path().to_path_buf(),
        host_read_bytes: 8 * MIB,
        repeats: 1,
        ..DoctorOptions::default()
    };
    let text = render_text(&diagnose(&opts));
    assert!(text.contains("host read"), "{text}");
    let ceiling = text
        .lines()
        .find(|l| l.contains("hybrid ceiling"))
        .unwrap_or_else(|| panic!("no ceiling line in\n{text}"));
    assert!(ceiling.contains("GB/s"), "{ceiling}");
    // Without the measurement there is no ceiling to name.
    let text = render_text(&diagnose(&DoctorOptions {
        host_read_bytes: 0,
        ..opts
    }));
    assert!(!text.contains("hybrid ceiling"), "{text}");
}
