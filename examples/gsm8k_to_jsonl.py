"""Convert GSM8K's original JSONL ({"question", "answer": "...#### 42"}) to verl's row schema.

python examples/gsm8k_to_jsonl.py IN.jsonl OUT.jsonl
"""

import json
import sys

INSTRUCTION = "Solve the problem step by step. End with a line '#### <answer>'."


def convert(line_number: int, row: dict) -> dict:
    answer = row["answer"].split("####")[-1].strip().replace(",", "")
    return {
        "data_source": "gsm8k",
        "prompt": [{"role": "user", "content": f"{row['question']}\n\n{INSTRUCTION}"}],
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"index": line_number},
    }


def main(source: str, target: str) -> None:
    with open(source) as lines, open(target, "w") as out:
        for number, line in enumerate(lines, 1):
            if line.strip():
                out.write(json.dumps(convert(number, json.loads(line))) + "\n")


if __name__ == "__main__":
    main(*sys.argv[1:3])
