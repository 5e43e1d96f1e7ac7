//! Shipped-bundle headers and byte shuffling round trips.

use super::*;

#[test]
fn shuffle_round_trips_even_and_odd_lengths() {
    for len in [0usize, 1, 2, 3, 10, 4097] {
        let data: Vec<u8> = (0..len).map(|i| (i * 7 + i / 3) as u8).collect();
        let shuffled = shuffle_bytes(&data);
        assert_eq!(shuffled.len(), len);
        assert_eq!(unshuffle_bytes(&shuffled), data, "length {len}");
        if len >= 4 {
            // Low bytes first, then high bytes.
            assert_eq!(shuffled[0], data[0]);
            assert_eq!(shuffled[1], data[2]);
            assert_eq!(shuffled[len / 2], data[1]);
        }
    }
}

#[test]
fn every_bit_of_the_header_is_checked() {
    let header = ShipHeader {
        major: SHIP_MAJOR,
        minor: SHIP_MINOR,
        original_len: 1 << 20,
        chunk_size: DEFAULT_CHUNK_SIZE,
        chunk_count: 1,
        bundle_header_sha256: [7; 32],
    };
    let bytes = header.encode();
    assert_eq!(ShipHeader::decode(&bytes).unwrap(), header);
    for byte in 0..SHIP_HEADER_LEN {
        for bit in 0..8 {
            let mut damaged = bytes;
            damaged[byte] ^= 1 << bit;
            let err = ShipHeader::decode(&damaged).unwrap_err();
            assert!(
                matches!(
                    err,
                    FormatError::NotShipped { .. }
                        | FormatError::ShippedNewerMajor { .. }
                        | FormatError::ShippedHeaderCorrupt(_)
                ),
                "byte {byte} bit {bit}: {err}"
            );
        }
    }
}

#[test]
fn a_short_header_is_truncated_and_a_foreign_one_is_not_shipped() {
    let header = ShipHeader {
        major: SHIP_MAJOR,
        minor: SHIP_MINOR,
        original_len: 1 << 20,
        chunk_size: DEFAULT_CHUNK_SIZE,
        chunk_count: 1,
        bundle_header_sha256: [0; 32],
    }
    .encode();
    for len in [0, 3, 8, 50, SHIP_HEADER_LEN - 1] {
        let err = ShipHeader::decode(&header[..len]).unwrap_err();
        assert!(
            matches!(err, FormatError::ShippedTruncated { at, .. } if at == len as u64),
            "{len}: {err}"
        );
    }
    let err = ShipHeader::decode(b"SPECTER\0 a bundle, not shipped").unwrap_err();
    assert!(matches!(err, FormatError::NotShipped { .. }), "{err}");
}
