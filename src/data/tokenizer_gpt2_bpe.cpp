// GPT-2's byte-level BPE (vocab.json + merges.txt), as Megatron's GPT2BPETokenizer
// (megatron/training/tokenizer/gpt2_tokenization.py, itself OpenAI's encoder.py).
//
// encode(text): split the text into pre-tokens with GPT-2's regex (gpt2_pretokenize), map each
// pre-token's bytes to printable code points (bytes_to_unicode), apply the BPE merges by rank,
// and look the resulting pieces up in vocab.json. decode(ids): concatenate the pieces and map the
// code points back to bytes. The text "<|endoftext|>" inside a document is encoded as ordinary
// text, as Megatron does; only --append-eod adds the EOD id.
#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <iterator>
#include <climits>
#include <fstream>
#include <mutex>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <unordered_map>

#include "tokenizer_hf_parts.h"
#include "mfsdp/data/tokenizer.h"

namespace mfsdp {
namespace {

// ---- UTF-8 ---------------------------------------------------------------------------------------

using hf::append_utf8;  // one UTF-8 encoder for every tokenizer (tokenizer_hf_parts.h)

// Decodes the code point at text[i]; sets `len` to its byte length. An invalid or truncated
// sequence yields kInvalid with len 1 (the byte stands alone).
constexpr uint32_t kInvalid = 0xFFFFFFFFu;
uint32_t next_code_point(std::string_view text, size_t i, size_t& len) {
  const auto b0 = static_cast<unsigned char>(text[i]);
  len = 1;
  if (b0 < 0x80) return b0;
  int n;
  uint32_t cp;
  if ((b0 & 0xE0) == 0xC0) { n = 2; cp = b0 & 0x1F; }
  else if ((b0 & 0xF0) == 0xE0) { n = 3; cp = b0 & 0x0F; }
  else if ((b0 & 0xF8) == 0xF0) { n = 4; cp = b0 & 0x07; }
  else return kInvalid;
  if (i + n > text.size()) return kInvalid;
  for (int k = 1; k < n; ++k) {
    const auto b = static_cast<unsigned char>(text[i + k]);
    if ((b & 0xC0) != 0x80) return kInvalid;
    cp = (cp << 6) | (b & 0x3F);
  }
  // Overlong forms, surrogates and values beyond U+10FFFF are invalid.
  if ((n == 2 && cp < 0x80) || (n == 3 && cp < 0x800) || (n == 4 && cp < 0x10000) ||
      (cp >= 0xD800 && cp <= 0xDFFF) || cp > 0x10FFFF) {
    return kInvalid;
  }
  len = static_cast<size_t>(n);
  return cp;
}

// ---- character classes ---------------------------------------------------------------------------
//
// [Note: Unicode classes]
// The pre-tokenisation regexes use \s, \p{L} (letters) and \p{N} (numbers) over all of Unicode:
//   - \s: Unicode's White_Space code points (U+0009..U+000D, U+0020, U+0085, U+00A0, U+1680,
//     U+2000..U+200A, U+2028, U+2029, U+202F, U+205F, U+3000);
//   - \p{L}: general categories Lu, Ll, Lt, Lm, Lo; \p{N}: Nd, Nl, No;
//   - everything else (punctuation, symbols, marks such as Devanagari vowel signs, format and
//     private-use characters, unassigned code points) is "other".
// kClassRuns holds these classes for every code point as runs, generated from Unicode 14.0
// (Python 3's unicodedata in the reference environment; code points assigned by later Unicode
// versions count as "other" here) with:
//   import unicodedata
//   WS = {*range(9, 14), 0x20, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B), 0x2028, 0x2029,
//         0x202F, 0x205F, 0x3000}
//   def cls(cp):
//     if cp in WS: return 0
//     cat = unicodedata.category(chr(cp))
//     return 1 if cat[0] == "L" else 2 if cat[0] == "N" else 3
//   runs, prev = [], None
//   for cp in range(0x110000):
//     if cls(cp) != prev: runs.append(cp << 2 | cls(cp)); prev = cls(cp)
// Each entry is (first code point of the run << 2) | class. Invalid UTF-8 bytes are "other", one
// byte each (the tokenizers library never sees them: Python strings are valid Unicode).
enum class CharClass { kSpace = 0, kLetter = 1, kNumber = 2, kOther = 3 };

constexpr uint32_t kClassRuns[] = {
    0x00000003, 0x00000024, 0x0000003B, 0x00000080, 0x00000087, 0x000000C2, 0x000000EB, 0x00000105,
    0x0000016F, 0x00000185, 0x000001EF, 0x00000214, 0x0000021B, 0x00000280, 0x00000287, 0x000002A9,
    0x000002AF, 0x000002CA, 0x000002D3, 0x000002D5, 0x000002DB, 0x000002E6, 0x000002E9, 0x000002EF,
    0x000002F2, 0x000002FF, 0x00000301, 0x0000035F, 0x00000361, 0x000003DF, 0x000003E1, 0x00000B0B,
    0x00000B19, 0x00000B4B, 0x00000B81, 0x00000B97, 0x00000BB1, 0x00000BB7, 0x00000BB9, 0x00000BBF,
    0x00000DC1, 0x00000DD7, 0x00000DD9, 0x00000DE3, 0x00000DE9, 0x00000DFB, 0x00000DFD, 0x00000E03,
    0x00000E19, 0x00000E1F, 0x00000E21, 0x00000E2F, 0x00000E31, 0x00000E37, 0x00000E39, 0x00000E8B,
    0x00000E8D, 0x00000FDB, 0x00000FDD, 0x0000120B, 0x00001229, 0x000014C3, 0x000014C5, 0x0000155F,
    0x00001565, 0x0000156B, 0x00001581, 0x00001627, 0x00001741, 0x000017AF, 0x000017BD, 0x000017CF,
    0x00001881, 0x0000192F, 0x00001982, 0x000019AB, 0x000019B9, 0x000019C3, 0x000019C5, 0x00001B53,
    0x00001B55, 0x00001B5B, 0x00001B95, 0x00001B9F, 0x00001BB9, 0x00001BC2, 0x00001BE9, 0x00001BF7,
    0x00001BFD, 0x00001C03, 0x00001C41, 0x00001C47, 0x00001C49, 0x00001CC3, 0x00001D35, 0x00001E9B,
    0x00001EC5, 0x00001ECB, 0x00001F02, 0x00001F29, 0x00001FAF, 0x00001FD1, 0x00001FDB, 0x00001FE9,
    0x00001FEF, 0x00002001, 0x0000205B, 0x00002069, 0x0000206F, 0x00002091, 0x00002097, 0x000020A1,
    0x000020A7, 0x00002101, 0x00002167, 0x00002181, 0x000021AF, 0x000021C1, 0x00002223, 0x00002225,
    0x0000223F, 0x00002281, 0x0000232B, 0x00002411, 0x000024EB, 0x000024F5, 0x000024FB, 0x00002541,
    0x00002547, 0x00002561, 0x0000258B, 0x0000259A, 0x000025C3, 0x000025C5, 0x00002607, 0x00002615,
    0x00002637, 0x0000263D, 0x00002647, 0x0000264D, 0x000026A7, 0x000026A9, 0x000026C7, 0x000026C9,
    0x000026CF, 0x000026D9, 0x000026EB, 0x000026F5, 0x000026FB, 0x00002739, 0x0000273F, 0x00002771,
    0x0000277B, 0x0000277D, 0x0000278B, 0x0000279A, 0x000027C1, 0x000027CB, 0x000027D2, 0x000027EB,
    0x000027F1, 0x000027F7, 0x00002815, 0x0000282F, 0x0000283D, 0x00002847, 0x0000284D, 0x000028A7,
    0x000028A9, 0x000028C7, 0x000028C9, 0x000028D3, 0x000028D5, 0x000028DF, 0x000028E1, 0x000028EB,
    0x00002965, 0x00002977, 0x00002979, 0x0000297F, 0x0000299A, 0x000029C3, 0x000029C9, 0x000029D7,
    0x00002A15, 0x00002A3B, 0x00002A3D, 0x00002A4B, 0x00002A4D, 0x00002AA7, 0x00002AA9, 0x00002AC7,
    0x00002AC9, 0x00002AD3, 0x00002AD5, 0x00002AEB, 0x00002AF5, 0x00002AFB, 0x00002B41, 0x00002B47,
    0x00002B81, 0x00002B8B, 0x00002B9A, 0x00002BC3, 0x00002BE5, 0x00002BEB, 0x00002C15, 0x00002C37,
    0x00002C3D, 0x00002C47, 0x00002C4D, 0x00002CA7, 0x00002CA9, 0x00002CC7, 0x00002CC9, 0x00002CD3,
    0x00002CD5, 0x00002CEB, 0x00002CF5, 0x00002CFB, 0x00002D71, 0x00002D7B, 0x00002D7D, 0x00002D8B,
    0x00002D9A, 0x00002DC3, 0x00002DC5, 0x00002DCA, 0x00002DE3, 0x00002E0D, 0x00002E13, 0x00002E15,
    0x00002E2F, 0x00002E39, 0x00002E47, 0x00002E49, 0x00002E5B, 0x00002E65, 0x00002E6F, 0x00002E71,
    0x00002E77, 0x00002E79, 0x00002E83, 0x00002E8D, 0x00002E97, 0x00002EA1, 0x00002EAF, 0x00002EB9,
    0x00002EEB, 0x00002F41, 0x00002F47, 0x00002F9A, 0x00002FCF, 0x00003015, 0x00003037, 0x00003039,
    0x00003047, 0x00003049, 0x000030A7, 0x000030A9, 0x000030EB, 0x000030F5, 0x000030FB, 0x00003161,
    0x0000316F, 0x00003175, 0x0000317B, 0x00003181, 0x0000318B, 0x0000319A, 0x000031C3, 0x000031E2,
    0x000031FF, 0x00003201, 0x00003207, 0x00003215, 0x00003237, 0x00003239, 0x00003247, 0x00003249,
    0x000032A7, 0x000032A9, 0x000032D3, 0x000032D5, 0x000032EB, 0x000032F5, 0x000032FB, 0x00003375,
    0x0000337F, 0x00003381, 0x0000338B, 0x0000339A, 0x000033C3, 0x000033C5, 0x000033CF, 0x00003411,
    0x00003437, 0x00003439, 0x00003447, 0x00003449, 0x000034EF, 0x000034F5, 0x000034FB, 0x00003539,
    0x0000353F, 0x00003551, 0x0000355F, 0x00003562, 0x0000357D, 0x0000358B, 0x0000359A, 0x000035E7,
    0x000035E9, 0x00003603, 0x00003615, 0x0000365F, 0x00003669, 0x000036CB, 0x000036CD, 0x000036F3,
    0x000036F5, 0x000036FB, 0x00003701, 0x0000371F, 0x0000379A, 0x000037C3, 0x00003805, 0x000038C7,
    0x000038C9, 0x000038D3, 0x00003901, 0x0000391F, 0x00003942, 0x0000396B, 0x00003A05, 0x00003A0F,
    0x00003A11, 0x00003A17, 0x00003A19, 0x00003A2F, 0x00003A31, 0x00003A93, 0x00003A95, 0x00003A9B,
    0x00003A9D, 0x00003AC7, 0x00003AC9, 0x00003AD3, 0x00003AF5, 0x00003AFB, 0x00003B01, 0x00003B17,
    0x00003B19, 0x00003B1F, 0x00003B42, 0x00003B6B, 0x00003B71, 0x00003B83, 0x00003C01, 0x00003C07,
    0x00003C82, 0x00003CD3, 0x00003D01, 0x00003D23, 0x00003D25, 0x00003DB7, 0x00003E21, 0x00003E37,
    0x00004001, 0x000040AF, 0x000040FD, 0x00004102, 0x0000412B, 0x00004141, 0x0000415B, 0x00004169,
    0x0000417B, 0x00004185, 0x0000418B, 0x00004195, 0x0000419F, 0x000041B9, 0x000041C7, 0x000041D5,
    0x0000420B, 0x00004239, 0x0000423F, 0x00004242, 0x0000426B, 0x00004281, 0x0000431B, 0x0000431D,
    0x00004323, 0x00004335, 0x0000433B, 0x00004341, 0x000043EF, 0x000043F1, 0x00004927, 0x00004929,
    0x0000493B, 0x00004941, 0x0000495F, 0x00004961, 0x00004967, 0x00004969, 0x0000497B, 0x00004981,
    0x00004A27, 0x00004A29, 0x00004A3B, 0x00004A41, 0x00004AC7, 0x00004AC9, 0x00004ADB, 0x00004AE1,
    0x00004AFF, 0x00004B01, 0x00004B07, 0x00004B09, 0x00004B1B, 0x00004B21, 0x00004B5F, 0x00004B61,
    0x00004C47, 0x00004C49, 0x00004C5B, 0x00004C61, 0x00004D6F, 0x00004DA6, 0x00004DF7, 0x00004E01,
    0x00004E43, 0x00004E81, 0x00004FDB, 0x00004FE1, 0x00004FFB, 0x00005005, 0x000059B7, 0x000059BD,
    0x00005A00, 0x00005A05, 0x00005A6F, 0x00005A81, 0x00005BAF, 0x00005BBA, 0x00005BC5, 0x00005BE7,
    0x00005C01, 0x00005C4B, 0x00005C7D, 0x00005CCB, 0x00005D01, 0x00005D4B, 0x00005D81, 0x00005DB7,
    0x00005DB9, 0x00005DC7, 0x00005E01, 0x00005ED3, 0x00005F5D, 0x00005F63, 0x00005F71, 0x00005F77,
    0x00005F82, 0x00005FAB, 0x00005FC2, 0x00005FEB, 0x00006042, 0x0000606B, 0x00006081, 0x000061E7,
    0x00006201, 0x00006217, 0x0000621D, 0x000062A7, 0x000062A9, 0x000062AF, 0x000062C1, 0x000063DB,
    0x00006401, 0x0000647F, 0x0000651A, 0x00006541, 0x000065BB, 0x000065C1, 0x000065D7, 0x00006601,
    0x000066B3, 0x000066C1, 0x0000672B, 0x00006742, 0x0000676F, 0x00006801, 0x0000685F, 0x00006881,
    0x00006957, 0x00006A02, 0x00006A2B, 0x00006A42, 0x00006A6B, 0x00006A9D, 0x00006AA3, 0x00006C15,
    0x00006CD3, 0x00006D15, 0x00006D37, 0x00006D42, 0x00006D6B, 0x00006E0D, 0x00006E87, 0x00006EB9,
    0x00006EC2, 0x00006EE9, 0x00006F9B, 0x00007001, 0x00007093, 0x00007102, 0x0000712B, 0x00007135,
    0x00007142, 0x00007169, 0x000071FB, 0x00007201, 0x00007227, 0x00007241, 0x000072EF, 0x000072F5,
    0x00007303, 0x000073A5, 0x000073B7, 0x000073B9, 0x000073D3, 0x000073D5, 0x000073DF, 0x000073E9,
    0x000073EF, 0x00007401, 0x00007703, 0x00007801, 0x00007C5B, 0x00007C61, 0x00007C7B, 0x00007C81,
    0x00007D1B, 0x00007D21, 0x00007D3B, 0x00007D41, 0x00007D63, 0x00007D65, 0x00007D6B, 0x00007D6D,
    0x00007D73, 0x00007D75, 0x00007D7B, 0x00007D7D, 0x00007DFB, 0x00007E01, 0x00007ED7, 0x00007ED9,
    0x00007EF7, 0x00007EF9, 0x00007EFF, 0x00007F09, 0x00007F17, 0x00007F19, 0x00007F37, 0x00007F41,
    0x00007F53, 0x00007F59, 0x00007F73, 0x00007F81, 0x00007FB7, 0x00007FC9, 0x00007FD7, 0x00007FD9,
    0x00007FF7, 0x00008000, 0x0000802F, 0x000080A0, 0x000080AB, 0x000080BC, 0x000080C3, 0x0000817C,
    0x00008183, 0x000081C2, 0x000081C5, 0x000081CB, 0x000081D2, 0x000081EB, 0x000081FD, 0x00008202,
    0x0000822B, 0x00008241, 0x00008277, 0x00008409, 0x0000840F, 0x0000841D, 0x00008423, 0x00008429,
    0x00008453, 0x00008455, 0x0000845B, 0x00008465, 0x0000847B, 0x00008491, 0x00008497, 0x00008499,
    0x0000849F, 0x000084A1, 0x000084A7, 0x000084A9, 0x000084BB, 0x000084BD, 0x000084EB, 0x000084F1,
    0x00008503, 0x00008515, 0x0000852B, 0x00008539, 0x0000853F, 0x00008542, 0x0000860D, 0x00008616,
    0x0000862B, 0x00009182, 0x00009273, 0x000093AA, 0x00009403, 0x00009DDA, 0x00009E53, 0x0000B001,
    0x0000B397, 0x0000B3AD, 0x0000B3BF, 0x0000B3C9, 0x0000B3D3, 0x0000B3F6, 0x0000B3FB, 0x0000B401,
    0x0000B49B, 0x0000B49D, 0x0000B4A3, 0x0000B4B5, 0x0000B4BB, 0x0000B4C1, 0x0000B5A3, 0x0000B5BD,
    0x0000B5C3, 0x0000B601, 0x0000B65F, 0x0000B681, 0x0000B69F, 0x0000B6A1, 0x0000B6BF, 0x0000B6C1,
    0x0000B6DF, 0x0000B6E1, 0x0000B6FF, 0x0000B701, 0x0000B71F, 0x0000B721, 0x0000B73F, 0x0000B741,
    0x0000B75F, 0x0000B761, 0x0000B77F, 0x0000B8BD, 0x0000B8C3, 0x0000C000, 0x0000C007, 0x0000C015,
    0x0000C01E, 0x0000C023, 0x0000C086, 0x0000C0AB, 0x0000C0C5, 0x0000C0DB, 0x0000C0E2, 0x0000C0ED,
    0x0000C0F7, 0x0000C105, 0x0000C25F, 0x0000C275, 0x0000C283, 0x0000C285, 0x0000C3EF, 0x0000C3F1,
    0x0000C403, 0x0000C415, 0x0000C4C3, 0x0000C4C5, 0x0000C63F, 0x0000C64A, 0x0000C65B, 0x0000C681,
    0x0000C703, 0x0000C7C1, 0x0000C803, 0x0000C882, 0x0000C8AB, 0x0000C922, 0x0000C943, 0x0000C946,
    0x0000C983, 0x0000CA02, 0x0000CA2B, 0x0000CAC6, 0x0000CB03, 0x0000D001, 0x00013703, 0x00013801,
    0x00029237, 0x00029341, 0x000293FB, 0x00029401, 0x00029837, 0x00029841, 0x00029882, 0x000298A9,
    0x000298B3, 0x00029901, 0x000299BF, 0x000299FD, 0x00029A7B, 0x00029A81, 0x00029B9A, 0x00029BC3,
    0x00029C5D, 0x00029C83, 0x00029C89, 0x00029E27, 0x00029E2D, 0x00029F2F, 0x00029F41, 0x00029F4B,
    0x00029F4D, 0x00029F53, 0x00029F55, 0x00029F6B, 0x00029FC9, 0x0002A00B, 0x0002A00D, 0x0002A01B,
    0x0002A01D, 0x0002A02F, 0x0002A031, 0x0002A08F, 0x0002A0C2, 0x0002A0DB, 0x0002A101, 0x0002A1D3,
    0x0002A209, 0x0002A2D3, 0x0002A342, 0x0002A36B, 0x0002A3C9, 0x0002A3E3, 0x0002A3ED, 0x0002A3F3,
    0x0002A3F5, 0x0002A3FF, 0x0002A402, 0x0002A429, 0x0002A49B, 0x0002A4C1, 0x0002A51F, 0x0002A581,
    0x0002A5F7, 0x0002A611, 0x0002A6CF, 0x0002A73D, 0x0002A742, 0x0002A76B, 0x0002A781, 0x0002A797,
    0x0002A799, 0x0002A7C2, 0x0002A7E9, 0x0002A7FF, 0x0002A801, 0x0002A8A7, 0x0002A901, 0x0002A90F,
    0x0002A911, 0x0002A933, 0x0002A942, 0x0002A96B, 0x0002A981, 0x0002A9DF, 0x0002A9E9, 0x0002A9EF,
    0x0002A9F9, 0x0002AAC3, 0x0002AAC5, 0x0002AACB, 0x0002AAD5, 0x0002AADF, 0x0002AAE5, 0x0002AAFB,
    0x0002AB01, 0x0002AB07, 0x0002AB09, 0x0002AB0F, 0x0002AB6D, 0x0002AB7B, 0x0002AB81, 0x0002ABAF,
    0x0002ABC9, 0x0002ABD7, 0x0002AC05, 0x0002AC1F, 0x0002AC25, 0x0002AC3F, 0x0002AC45, 0x0002AC5F,
    0x0002AC81, 0x0002AC9F, 0x0002ACA1, 0x0002ACBF, 0x0002ACC1, 0x0002AD6F, 0x0002AD71, 0x0002ADAB,
    0x0002ADC1, 0x0002AF8F, 0x0002AFC2, 0x0002AFEB, 0x0002B001, 0x00035E93, 0x00035EC1, 0x00035F1F,
    0x00035F2D, 0x00035FF3, 0x0003E401, 0x0003E9BB, 0x0003E9C1, 0x0003EB6B, 0x0003EC01, 0x0003EC1F,
    0x0003EC4D, 0x0003EC63, 0x0003EC75, 0x0003EC7B, 0x0003EC7D, 0x0003ECA7, 0x0003ECA9, 0x0003ECDF,
    0x0003ECE1, 0x0003ECF7, 0x0003ECF9, 0x0003ECFF, 0x0003ED01, 0x0003ED0B, 0x0003ED0D, 0x0003ED17,
    0x0003ED19, 0x0003EECB, 0x0003EF4D, 0x0003F4FB, 0x0003F541, 0x0003F643, 0x0003F649, 0x0003F723,
    0x0003F7C1, 0x0003F7F3, 0x0003F9C1, 0x0003F9D7, 0x0003F9D9, 0x0003FBF7, 0x0003FC42, 0x0003FC6B,
    0x0003FC85, 0x0003FCEF, 0x0003FD05, 0x0003FD6F, 0x0003FD99, 0x0003FEFF, 0x0003FF09, 0x0003FF23,
    0x0003FF29, 0x0003FF43, 0x0003FF49, 0x0003FF63, 0x0003FF69, 0x0003FF77, 0x00040001, 0x00040033,
    0x00040035, 0x0004009F, 0x000400A1, 0x000400EF, 0x000400F1, 0x000400FB, 0x000400FD, 0x0004013B,
    0x00040141, 0x0004017B, 0x00040201, 0x000403EF, 0x0004041E, 0x000404D3, 0x00040502, 0x000405E7,
    0x0004062A, 0x00040633, 0x00040A01, 0x00040A77, 0x00040A81, 0x00040B47, 0x00040B86, 0x00040BF3,
    0x00040C01, 0x00040C82, 0x00040C93, 0x00040CB5, 0x00040D06, 0x00040D09, 0x00040D2A, 0x00040D2F,
    0x00040D41, 0x00040DDB, 0x00040E01, 0x00040E7B, 0x00040E81, 0x00040F13, 0x00040F21, 0x00040F43,
    0x00040F46, 0x00040F5B, 0x00041001, 0x0004127B, 0x00041282, 0x000412AB, 0x000412C1, 0x00041353,
    0x00041361, 0x000413F3, 0x00041401, 0x000414A3, 0x000414C1, 0x00041593, 0x000415C1, 0x000415EF,
    0x000415F1, 0x0004162F, 0x00041631, 0x0004164F, 0x00041651, 0x0004165B, 0x0004165D, 0x0004168B,
    0x0004168D, 0x000416CB, 0x000416CD, 0x000416EB, 0x000416ED, 0x000416F7, 0x00041801, 0x00041CDF,
    0x00041D01, 0x00041D5B, 0x00041D81, 0x00041DA3, 0x00041E01, 0x00041E1B, 0x00041E1D, 0x00041EC7,
    0x00041EC9, 0x00041EEF, 0x00042001, 0x0004201B, 0x00042021, 0x00042027, 0x00042029, 0x000420DB,
    0x000420DD, 0x000420E7, 0x000420F1, 0x000420F7, 0x000420FD, 0x0004215B, 0x00042162, 0x00042181,
    0x000421DF, 0x000421E6, 0x00042201, 0x0004227F, 0x0004229E, 0x000422C3, 0x00042381, 0x000423CF,
    0x000423D1, 0x000423DB, 0x000423EE, 0x00042401, 0x0004245A, 0x00042473, 0x00042481, 0x000424EB,
    0x00042601, 0x000426E3, 0x000426F2, 0x000426F9, 0x00042702, 0x00042743, 0x0004274A, 0x00042801,
    0x00042807, 0x00042841, 0x00042853, 0x00042855, 0x00042863, 0x00042865, 0x000428DB, 0x00042902,
    0x00042927, 0x00042981, 0x000429F6, 0x000429FF, 0x00042A01, 0x00042A76, 0x00042A83, 0x00042B01,
    0x00042B23, 0x00042B25, 0x00042B97, 0x00042BAE, 0x00042BC3, 0x00042C01, 0x00042CDB, 0x00042D01,
    0x00042D5B, 0x00042D62, 0x00042D81, 0x00042DCF, 0x00042DE2, 0x00042E01, 0x00042E4B, 0x00042EA6,
    0x00042EC3, 0x00043001, 0x00043127, 0x00043201, 0x000432CF, 0x00043301, 0x000433CF, 0x000433EA,
    0x00043401, 0x00043493, 0x000434C2, 0x000434EB, 0x00043982, 0x000439FF, 0x00043A01, 0x00043AAB,
    0x00043AC1, 0x00043ACB, 0x00043C01, 0x00043C76, 0x00043C9D, 0x00043CA3, 0x00043CC1, 0x00043D1B,
    0x00043D46, 0x00043D57, 0x00043DC1, 0x00043E0B, 0x00043EC1, 0x00043F16, 0x00043F33, 0x00043F81,
    0x00043FDF, 0x0004400D, 0x000440E3, 0x0004414A, 0x000441C3, 0x000441C5, 0x000441CF, 0x000441D5,
    0x000441DB, 0x0004420D, 0x000442C3, 0x00044341, 0x000443A7, 0x000443C2, 0x000443EB, 0x0004440D,
    0x0004449F, 0x000444DA, 0x00044503, 0x00044511, 0x00044517, 0x0004451D, 0x00044523, 0x00044541,
    0x000445CF, 0x000445D9, 0x000445DF, 0x0004460D, 0x000446CF, 0x00044705, 0x00044717, 0x00044742,
    0x00044769, 0x0004476F, 0x00044771, 0x00044777, 0x00044786, 0x000447D7, 0x00044801, 0x0004484B,
    0x0004484D, 0x000448B3, 0x00044A01, 0x00044A1F, 0x00044A21, 0x00044A27, 0x00044A29, 0x00044A3B,
    0x00044A3D, 0x00044A7B, 0x00044A7D, 0x00044AA7, 0x00044AC1, 0x00044B7F, 0x00044BC2, 0x00044BEB,
    0x00044C15, 0x00044C37, 0x00044C3D, 0x00044C47, 0x00044C4D, 0x00044CA7, 0x00044CA9, 0x00044CC7,
    0x00044CC9, 0x00044CD3, 0x00044CD5, 0x00044CEB, 0x00044CF5, 0x00044CFB, 0x00044D41, 0x00044D47,
    0x00044D75, 0x00044D8B, 0x00045001, 0x000450D7, 0x0004511D, 0x0004512F, 0x00045142, 0x0004516B,
    0x0004517D, 0x0004518B, 0x00045201, 0x000452C3, 0x00045311, 0x0004531B, 0x0004531D, 0x00045323,
    0x00045342, 0x0004536B, 0x00045601, 0x000456BF, 0x00045761, 0x00045773, 0x00045801, 0x000458C3,
    0x00045911, 0x00045917, 0x00045942, 0x0004596B, 0x00045A01, 0x00045AAF, 0x00045AE1, 0x00045AE7,
    0x00045B02, 0x00045B2B, 0x00045C01, 0x00045C6F, 0x00045CC2, 0x00045CF3, 0x00045D01, 0x00045D1F,
    0x00046001, 0x000460B3, 0x00046281, 0x00046382, 0x000463CF, 0x000463FD, 0x0004641F, 0x00046425,
    0x0004642B, 0x00046431, 0x00046453, 0x00046455, 0x0004645F, 0x00046461, 0x000464C3, 0x000464FD,
    0x00046503, 0x00046505, 0x0004650B, 0x00046542, 0x0004656B, 0x00046681, 0x000466A3, 0x000466A9,
    0x00046747, 0x00046785, 0x0004678B, 0x0004678D, 0x00046793, 0x00046801, 0x00046807, 0x0004682D,
    0x000468CF, 0x000468E9, 0x000468EF, 0x00046941, 0x00046947, 0x00046971, 0x00046A2B, 0x00046A75,
    0x00046A7B, 0x00046AC1, 0x00046BE7, 0x00047001, 0x00047027, 0x00047029, 0x000470BF, 0x00047101,
    0x00047107, 0x00047142, 0x000471B7, 0x000471C9, 0x00047243, 0x00047401, 0x0004741F, 0x00047421,
    0x0004742B, 0x0004742D, 0x000474C7, 0x00047519, 0x0004751F, 0x00047542, 0x0004756B, 0x00047581,
    0x0004759B, 0x0004759D, 0x000475A7, 0x000475A9, 0x0004762B, 0x00047661, 0x00047667, 0x00047682,
    0x000476AB, 0x00047B81, 0x00047BCF, 0x00047EC1, 0x00047EC7, 0x00047F02, 0x00047F57, 0x00048001,
    0x00048E6B, 0x00049002, 0x000491BF, 0x00049201, 0x00049513, 0x0004BE41, 0x0004BFC7, 0x0004C001,
    0x0004D0BF, 0x00051001, 0x0005191F, 0x0005A001, 0x0005A8E7, 0x0005A901, 0x0005A97F, 0x0005A982,
    0x0005A9AB, 0x0005A9C1, 0x0005AAFF, 0x0005AB02, 0x0005AB2B, 0x0005AB41, 0x0005ABBB, 0x0005AC01,
    0x0005ACC3, 0x0005AD01, 0x0005AD13, 0x0005AD42, 0x0005AD6B, 0x0005AD6E, 0x0005AD8B, 0x0005AD8D,
    0x0005ADE3, 0x0005ADF5, 0x0005AE43, 0x0005B901, 0x0005BA02, 0x0005BA5F, 0x0005BC01, 0x0005BD2F,
    0x0005BD41, 0x0005BD47, 0x0005BE4D, 0x0005BE83, 0x0005BF81, 0x0005BF8B, 0x0005BF8D, 0x0005BF93,
    0x0005C001, 0x00061FE3, 0x00062001, 0x0006335B, 0x00063401, 0x00063427, 0x0006BFC1, 0x0006BFD3,
    0x0006BFD5, 0x0006BFF3, 0x0006BFF5, 0x0006BFFF, 0x0006C001, 0x0006C48F, 0x0006C541, 0x0006C54F,
    0x0006C591, 0x0006C5A3, 0x0006C5C1, 0x0006CBF3, 0x0006F001, 0x0006F1AF, 0x0006F1C1, 0x0006F1F7,
    0x0006F201, 0x0006F227, 0x0006F241, 0x0006F26B, 0x00074B82, 0x00074BD3, 0x00074D82, 0x00074DE7,
    0x00075001, 0x00075157, 0x00075159, 0x00075277, 0x00075279, 0x00075283, 0x00075289, 0x0007528F,
    0x00075295, 0x0007529F, 0x000752A5, 0x000752B7, 0x000752B9, 0x000752EB, 0x000752ED, 0x000752F3,
    0x000752F5, 0x00075313, 0x00075315, 0x0007541B, 0x0007541D, 0x0007542F, 0x00075435, 0x00075457,
    0x00075459, 0x00075477, 0x00075479, 0x000754EB, 0x000754ED, 0x000754FF, 0x00075501, 0x00075517,
    0x00075519, 0x0007551F, 0x00075529, 0x00075547, 0x00075549, 0x00075A9B, 0x00075AA1, 0x00075B07,
    0x00075B09, 0x00075B6F, 0x00075B71, 0x00075BEF, 0x00075BF1, 0x00075C57, 0x00075C59, 0x00075CD7,
    0x00075CD9, 0x00075D3F, 0x00075D41, 0x00075DBF, 0x00075DC1, 0x00075E27, 0x00075E29, 0x00075EA7,
    0x00075EA9, 0x00075F0F, 0x00075F11, 0x00075F33, 0x00075F3A, 0x00076003, 0x00077C01, 0x00077C7F,
    0x00078401, 0x000784B7, 0x000784DD, 0x000784FB, 0x00078502, 0x0007852B, 0x00078539, 0x0007853F,
    0x00078A41, 0x00078ABB, 0x00078B01, 0x00078BB3, 0x00078BC2, 0x00078BEB, 0x00079F81, 0x00079F9F,
    0x00079FA1, 0x00079FB3, 0x00079FB5, 0x00079FBF, 0x00079FC1, 0x00079FFF, 0x0007A001, 0x0007A317,
    0x0007A31E, 0x0007A343, 0x0007A401, 0x0007A513, 0x0007A52D, 0x0007A533, 0x0007A542, 0x0007A56B,
    0x0007B1C6, 0x0007B2B3, 0x0007B2B6, 0x0007B2C3, 0x0007B2C6, 0x0007B2D7, 0x0007B406, 0x0007B4BB,
    0x0007B4BE, 0x0007B4FB, 0x0007B801, 0x0007B813, 0x0007B815, 0x0007B883, 0x0007B885, 0x0007B88F,
    0x0007B891, 0x0007B897, 0x0007B89D, 0x0007B8A3, 0x0007B8A5, 0x0007B8CF, 0x0007B8D1, 0x0007B8E3,
    0x0007B8E5, 0x0007B8EB, 0x0007B8ED, 0x0007B8F3, 0x0007B909, 0x0007B90F, 0x0007B91D, 0x0007B923,
    0x0007B925, 0x0007B92B, 0x0007B92D, 0x0007B933, 0x0007B935, 0x0007B943, 0x0007B945, 0x0007B94F,
    0x0007B951, 0x0007B957, 0x0007B95D, 0x0007B963, 0x0007B965, 0x0007B96B, 0x0007B96D, 0x0007B973,
    0x0007B975, 0x0007B97B, 0x0007B97D, 0x0007B983, 0x0007B985, 0x0007B98F, 0x0007B991, 0x0007B997,
    0x0007B99D, 0x0007B9AF, 0x0007B9B1, 0x0007B9CF, 0x0007B9D1, 0x0007B9E3, 0x0007B9E5, 0x0007B9F7,
    0x0007B9F9, 0x0007B9FF, 0x0007BA01, 0x0007BA2B, 0x0007BA2D, 0x0007BA73, 0x0007BA85, 0x0007BA93,
    0x0007BA95, 0x0007BAAB, 0x0007BAAD, 0x0007BAF3, 0x0007C402, 0x0007C437, 0x0007EFC2, 0x0007EFEB,
    0x00080001, 0x000A9B83, 0x000A9C01, 0x000ADCE7, 0x000ADD01, 0x000AE07B, 0x000AE081, 0x000B3A8B,
    0x000B3AC1, 0x000BAF87, 0x000BE001, 0x000BE87B, 0x000C0001, 0x000C4D2F,
};

CharClass classify(uint32_t cp) {
  if (cp == kInvalid || cp > 0x10FFFF) return CharClass::kOther;
  // The last run starting at or before cp.
  const uint32_t* it = std::upper_bound(std::begin(kClassRuns), std::end(kClassRuns), cp,
                                        [](uint32_t c, uint32_t run) { return c < (run >> 2); });
  return static_cast<CharClass>(*(it - 1) & 3);
}

// ---- bytes_to_unicode ----------------------------------------------------------------------------

// GPT-2's table: printable bytes ('!'..'~', U+00A1..U+00AC, U+00AE..U+00FF) stand for
// themselves; the other 68 bytes, in increasing order, map to U+0100, U+0101, ...
std::array<uint32_t, 256> make_byte_to_unicode() {
  std::array<uint32_t, 256> table{};
  uint32_t next = 256;
  for (uint32_t b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
    table[b] = printable ? b : next++;
  }
  return table;
}

const std::array<uint32_t, 256>& byte_to_unicode_table() {
  static const std::array<uint32_t, 256> table = make_byte_to_unicode();
  return table;
}

std::string read_text_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error(path + ": cannot open for reading");
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Megatron's GPT2BPETokenizer: vocab.json + merges.txt over ByteLevelBpe.
class GPT2BPETokenizer : public Tokenizer {
 public:
  GPT2BPETokenizer(const std::string& vocab_file, const std::string& merge_file)
      : vocab_file_(vocab_file) {
    auto vocab = load_vocab(vocab_file);
    bpe_ = std::make_unique<ByteLevelBpe>(vocab, load_merges(merge_file), /*ignore_merges=*/false,
                                          vocab_file);
    // Megatron uses len(encoder); for every real vocabulary (ids 0..n-1) that is max_id + 1.
    vocab_size_ = bpe_->max_id() + 1;
    const std::optional<int64_t> eod = bpe_->id_of("<|endoftext|>");
    if (!eod) {
      throw std::runtime_error(vocab_file + ": has no \"<|endoftext|>\" entry, which GPT-2 BPE " +
                               "uses as the end-of-document id");
    }
    eod_ = *eod;
  }

  std::vector<int64_t> encode(std::string_view text) const override {
    std::vector<int64_t> ids;
    for (const std::string& piece : gpt2_pretokenize(text)) bpe_->encode(piece, ids);
    return ids;
  }

  std::string decode(const std::vector<int64_t>& ids) const override {
    std::string text;
    for (int64_t id : ids) {
      if (id < 0 || id >= vocab_size_ || !bpe_->decode(id, text)) {
        throw std::out_of_range(vocab_file_ + ": id " + std::to_string(id) +
                                " is not in the vocabulary");
      }
    }
    return text;
  }

  int64_t vocab_size() const override { return vocab_size_; }
  int64_t eod() const override { return eod_; }
  std::string name() const override { return "GPT2BPETokenizer"; }
  std::optional<int64_t> special_token_id(std::string_view token) const override {
    if (token == "<|endoftext|>") return eod_;
    return std::nullopt;
  }

 private:
  static std::vector<std::pair<std::string, int64_t>> load_vocab(const std::string& path) {
    nlohmann::json vocab;
    try {
      vocab = nlohmann::json::parse(read_text_file(path));
    } catch (const nlohmann::json::exception& e) {
      throw std::runtime_error(path + ": not valid JSON: " + e.what());
    }
    if (!vocab.is_object()) {
      throw std::runtime_error(path + ": expected a JSON object mapping pieces to ids");
    }
    std::vector<std::pair<std::string, int64_t>> out;
    for (auto it = vocab.begin(); it != vocab.end(); ++it) {
      if (!it.value().is_number_integer() || it.value().get<int64_t>() < 0) {
        throw std::runtime_error(path + ": the id of piece \"" + it.key() +
                                 "\" is not a non-negative integer");
      }
      out.emplace_back(it.key(), it.value().get<int64_t>());
    }
    return out;
  }

  static std::vector<std::pair<std::string, std::string>> load_merges(const std::string& path) {
    std::istringstream in(read_text_file(path));
    std::string line;
    int64_t line_no = 0;
    std::vector<std::pair<std::string, std::string>> merges;
    while (std::getline(in, line)) {
      ++line_no;
      if (!line.empty() && line.back() == '\r') line.pop_back();
      if (line_no == 1 && line.rfind("#version", 0) == 0) continue;
      std::istringstream fields(line);
      std::string left, right, extra;
      if (!(fields >> left)) continue;  // blank line
      if (!(fields >> right) || (fields >> extra)) {
        throw std::runtime_error(path + ":" + std::to_string(line_no) +
                                 ": expected two space-separated pieces, found \"" + line + "\"");
      }
      merges.emplace_back(std::move(left), std::move(right));
    }
    return merges;
  }

  std::string vocab_file_;
  std::unique_ptr<ByteLevelBpe> bpe_;
  int64_t vocab_size_ = 0;
  int64_t eod_ = -1;
};

}  // namespace

// ---- ByteLevelBpe --------------------------------------------------------------------------------

struct ByteLevelBpe::Impl {
  std::string source;
  bool ignore_merges = false;
  std::unordered_map<std::string, int64_t> encoder;   // piece -> id
  std::unordered_map<int64_t, std::string> decoder;   // id -> the bytes it stands for
  std::unordered_map<std::string, int> merge_ranks;   // "left right" -> rank (lower first)
  std::array<std::string, 256> byte_symbol;           // byte -> UTF-8 of its code point
  int64_t max_id = -1;
  mutable std::mutex cache_mutex;
  mutable std::unordered_map<std::string, std::vector<int64_t>> cache;  // pre-token -> ids
};

ByteLevelBpe::ByteLevelBpe(const std::vector<std::pair<std::string, int64_t>>& vocab,
                           const std::vector<std::pair<std::string, std::string>>& merges,
                           bool ignore_merges, std::string source)
    : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.source = std::move(source);
  m.ignore_merges = ignore_merges;
  const auto& table = byte_to_unicode_table();
  std::unordered_map<uint32_t, uint8_t> unicode_to_byte;
  for (int b = 0; b < 256; ++b) {
    append_utf8(table[b], m.byte_symbol[b]);
    unicode_to_byte[table[b]] = static_cast<uint8_t>(b);
  }
  for (const auto& [piece, id] : vocab) {
    m.encoder[piece] = id;
    m.max_id = std::max(m.max_id, id);
    // The bytes of the piece: each symbol back to its byte; a character that is no byte symbol
    // (not produced by byte-level pre-tokenisation) stands for its own UTF-8.
    std::string bytes;
    for (size_t i = 0; i < piece.size();) {
      size_t len;
      const uint32_t cp = next_code_point(piece, i, len);
      auto it = unicode_to_byte.find(cp);
      if (it != unicode_to_byte.end()) {
        bytes.push_back(static_cast<char>(it->second));
      } else {
        bytes.append(piece, i, len);
      }
      i += len;
    }
    m.decoder[id] = std::move(bytes);
  }
  int rank = 0;
  for (const auto& [left, right] : merges) m.merge_ranks.emplace(left + " " + right, rank++);
}

ByteLevelBpe::~ByteLevelBpe() = default;

void ByteLevelBpe::encode(std::string_view pretoken, std::vector<int64_t>& out) const {
  const Impl& m = *impl_;
  const std::string key(pretoken);
  {
    std::lock_guard<std::mutex> lock(m.cache_mutex);
    auto it = m.cache.find(key);
    if (it != m.cache.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  std::vector<std::string> word;
  word.reserve(pretoken.size());
  for (unsigned char b : pretoken) word.push_back(m.byte_symbol[b]);

  std::vector<int64_t> ids;
  std::string whole;
  for (const std::string& symbol : word) whole += symbol;
  auto direct = m.ignore_merges ? m.encoder.find(whole) : m.encoder.end();
  if (direct != m.encoder.end()) {
    ids.push_back(direct->second);
  } else {
    while (word.size() > 1) {
      int best_rank = INT_MAX;
      size_t best = 0;
      for (size_t i = 0; i + 1 < word.size(); ++i) {
        auto it = m.merge_ranks.find(word[i] + " " + word[i + 1]);
        if (it != m.merge_ranks.end() && it->second < best_rank) {
          best_rank = it->second;
          best = i;
        }
      }
      if (best_rank == INT_MAX) break;
      const std::string first = word[best], second = word[best + 1];
      // Merge every occurrence of the pair, left to right, without overlaps (as GPT-2's bpe();
      // the tokenizers library's priority queue gives the same result for trained merges).
      std::vector<std::string> merged;
      merged.reserve(word.size());
      for (size_t i = 0; i < word.size();) {
        if (i + 1 < word.size() && word[i] == first && word[i + 1] == second) {
          merged.push_back(first + second);
          i += 2;
        } else {
          merged.push_back(word[i]);
          i += 1;
        }
      }
      word.swap(merged);
    }
    ids.reserve(word.size());
    for (const std::string& symbol : word) {
      auto it = m.encoder.find(symbol);
      if (it == m.encoder.end()) {
        throw std::runtime_error(m.source + ": no entry for the BPE piece \"" + symbol +
                                 "\" (the vocabulary and merges do not belong together, or the "
                                 "vocabulary lacks a byte symbol)");
      }
      ids.push_back(it->second);
    }
  }
  out.insert(out.end(), ids.begin(), ids.end());
  std::lock_guard<std::mutex> lock(m.cache_mutex);
  m.cache.emplace(key, std::move(ids));
}

bool ByteLevelBpe::decode(int64_t id, std::string& out) const {
  auto it = impl_->decoder.find(id);
  if (it == impl_->decoder.end()) return false;
  out += it->second;
  return true;
}

std::optional<int64_t> ByteLevelBpe::id_of(const std::string& piece) const {
  auto it = impl_->encoder.find(piece);
  if (it == impl_->encoder.end()) return std::nullopt;
  return it->second;
}

int64_t ByteLevelBpe::max_id() const { return impl_->max_id; }

uint32_t gpt2_byte_to_unicode(uint8_t byte) { return byte_to_unicode_table()[byte]; }

namespace {

// The code points of a text with their byte spans and classes, and the helpers both
// pre-tokenisers match with.
struct CodePoints {
  struct Cp { uint32_t cp; size_t begin, len; CharClass cls; };
  std::string_view text;
  std::vector<Cp> cps;
  std::vector<std::string> pieces;
  size_t i = 0;  // start of the next pre-token

  explicit CodePoints(std::string_view t) : text(t) {
    cps.reserve(text.size());
    for (size_t k = 0; k < text.size();) {
      size_t len;
      const uint32_t cp = next_code_point(text, k, len);
      cps.push_back({cp, k, len, classify(cp)});
      k += len;
    }
  }
  size_t size() const { return cps.size(); }
  CharClass cls(size_t k) const { return cps[k].cls; }
  bool is(size_t k, char c) const { return k < cps.size() && cps[k].cp == static_cast<uint32_t>(c); }
  bool is_newline(size_t k) const { return is(k, '\r') || is(k, '\n'); }
  // The pre-token is code points [i, end).
  void emit(size_t end) {
    const size_t b = cps[i].begin;
    const size_t e = cps[end - 1].begin + cps[end - 1].len;
    pieces.emplace_back(text.substr(b, e - b));
    i = end;
  }
  // The first index >= k not of class c.
  size_t run_end(size_t k, CharClass c) const {
    while (k < cps.size() && cls(k) == c) ++k;
    return k;
  }
  // `\s+(?!\S)|\s+` at i: a whitespace run; when a non-space follows, the run's last character
  // is left to start the next pre-token (unless the run is that one character).
  void emit_whitespace() {
    const size_t end = run_end(i, CharClass::kSpace);
    emit(end < size() && end - i >= 2 ? end - 1 : end);
  }
};

}  // namespace

std::vector<std::string> gpt2_pretokenize(std::string_view text) {
  CodePoints t(text);
  const size_t n = t.size();
  size_t& i = t.i;
  auto cls = [&](size_t k) { return t.cls(k); };
  auto is = [&](size_t k, char c) { return t.is(k, c); };
  auto emit = [&](size_t end) { t.emit(end); };
  auto run_end = [&](size_t k, CharClass c) { return t.run_end(k, c); };

  while (i < n) {
    // 's|'t|'re|'ve|'m|'ll|'d
    if (is(i, '\'')) {
      if (is(i + 1, 's') || is(i + 1, 't') || is(i + 1, 'm') || is(i + 1, 'd')) {
        emit(i + 2);
        continue;
      }
      if ((is(i + 1, 'r') && is(i + 2, 'e')) || (is(i + 1, 'v') && is(i + 2, 'e')) ||
          (is(i + 1, 'l') && is(i + 2, 'l'))) {
        emit(i + 3);
        continue;
      }
    }
    // ` ?\p{L}+`, ` ?\p{N}+`, ` ?[^\s\p{L}\p{N}]+`: an optional U+0020, then a run of one class.
    const size_t start = is(i, ' ') && i + 1 < n && cls(i + 1) != CharClass::kSpace ? i + 1 : i;
    const CharClass c = cls(start);
    if (c != CharClass::kSpace) {
      emit(run_end(start, c));
      continue;
    }
    // `\s+(?!\S)|\s+`
    t.emit_whitespace();
  }
  return std::move(t.pieces);
}

std::vector<std::string> llama3_pretokenize(std::string_view text, int max_digits) {
  CodePoints t(text);
  const size_t n = t.size();
  size_t& i = t.i;
  // Case-insensitive ASCII letter test; (?i) also lets 's match U+017F (long s), which Unicode
  // case-folds to 's'.
  auto is_ci = [&](size_t k, char lower) {
    return t.is(k, lower) || t.is(k, static_cast<char>(lower - 'a' + 'A')) ||
           (lower == 's' && k < n && t.cps[k].cp == 0x17F);
  };
  while (i < n) {
    // (?i:'s|'t|'re|'ve|'m|'ll|'d)
    if (t.is(i, '\'')) {
      if (is_ci(i + 1, 's') || is_ci(i + 1, 't') || is_ci(i + 1, 'm') || is_ci(i + 1, 'd')) {
        t.emit(i + 2);
        continue;
      }
      if ((is_ci(i + 1, 'r') && is_ci(i + 2, 'e')) || (is_ci(i + 1, 'v') && is_ci(i + 2, 'e')) ||
          (is_ci(i + 1, 'l') && is_ci(i + 2, 'l'))) {
        t.emit(i + 3);
        continue;
      }
    }
    // [^\r\n\p{L}\p{N}]?\p{L}+: letters, after at most one character that is no newline,
    // letter or number (a space, tab, punctuation mark).
    if (t.cls(i) == CharClass::kLetter) {
      t.emit(t.run_end(i, CharClass::kLetter));
      continue;
    }
    if (!t.is_newline(i) && t.cls(i) != CharClass::kNumber && i + 1 < n &&
        t.cls(i + 1) == CharClass::kLetter) {
      t.emit(t.run_end(i + 1, CharClass::kLetter));
      continue;
    }
    // \p{N}{1,3}
    if (t.cls(i) == CharClass::kNumber) {
      size_t end = i;
      while (end < n && end - i < static_cast<size_t>(max_digits) &&
             t.cls(end) == CharClass::kNumber) {
        ++end;
      }
      t.emit(end);
      continue;
    }
    // ` ?[^\s\p{L}\p{N}]+[\r\n]*`: punctuation and symbols (after an optional U+0020), with
    // the newlines that follow them.
    const size_t start = t.is(i, ' ') && i + 1 < n && t.cls(i + 1) == CharClass::kOther ? i + 1 : i;
    if (t.cls(start) == CharClass::kOther) {
      size_t end = t.run_end(start, CharClass::kOther);
      while (t.is_newline(end)) ++end;
      t.emit(end);
      continue;
    }
    // Here cps[i] is whitespace. `\s*[\r\n]+`: the whitespace run up to its last newline.
    const size_t ws_end = t.run_end(i, CharClass::kSpace);
    size_t last_newline = ws_end;
    for (size_t k = i; k < ws_end; ++k) {
      if (t.is_newline(k)) last_newline = k;
    }
    if (last_newline < ws_end) {
      t.emit(last_newline + 1);
      continue;
    }
    // `\s+(?!\S)|\s+`
    t.emit_whitespace();
  }
  return std::move(t.pieces);
}

std::unique_ptr<Tokenizer> load_gpt2_bpe_tokenizer(const std::string& vocab_file,
                                                   const std::string& merge_file) {
  return std::make_unique<GPT2BPETokenizer>(vocab_file, merge_file);
}

}  // namespace mfsdp
