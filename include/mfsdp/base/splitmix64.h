// splitmix64 (Steele, Lea, Flood 2014): a 64-bit hash that gives the same numbers on every
// compiler and standard library (std:: distributions do not promise that), for seeds derived from
// names and indices (parameter init, data order, rollout seeds, generated tasks).
// Header-only.
#pragma once

#include <cstdint>

namespace mfsdp {

// The finaliser: mixes the bits of z.
inline uint64_t splitmix64_mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// One step of the generator from state x: the golden-ratio increment, then the finaliser.
inline uint64_t splitmix64(uint64_t x) { return splitmix64_mix(x + 0x9E3779B97F4A7C15ull); }

}  // namespace mfsdp
